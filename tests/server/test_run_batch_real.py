"""run-batch on the real engine (tiny random Llama, float32, CPU): greedy lines give transformers'
tokens (PEFT's for an adapter line), and every line's status and body are what the HTTP server
answers for the same body (ids and timestamps aside), bad lines included; the command line once
end to end in a subprocess."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from loraplex.config import Settings
from loraplex.engine.async_engine import AsyncLLMEngine
from loraplex.registry import db
from loraplex.registry.adapter_manager import build_adapter_manager
from loraplex.registry.service import RegistryService
from loraplex.server.batch_adapters import LoraModule
from loraplex.server.batch_file import parse_lines
from loraplex.server.batch_runner import run_lines
from loraplex.server.batch_setup import build_batch_context, close_batch_context
from tests.engine.test_engine_exact import hf_greedy_all, tight_llm
from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for
from tests.server.conftest import start_server

N = 6  # tokens per answer
GREEDY = {"max_tokens": N, "min_tokens": N, "temperature": 0, "return_tokens_as_token_ids": True}
CHATS = [[{"role": "user", "content": "hello there"}],
         [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+2?"}]]
PROMPTS = ["The quick brown fox", "a"]
ENGINE_OPTIONS = dict(num_blocks=256, max_num_batched_tokens=512, max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def world(tiny_llama_dir, tmp_path_factory):
    """A batch context (``--lora-modules sql=...`` and ``--tenant acme``, whose registry holds
    the adapter ``support``) and a server on a second engine over the same weights."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("batch")
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    dirs = {"sql": make_peft_adapter(base, root / "sql", seed=5, r=4, target_modules=["q_proj", "v_proj", "down_proj"]),
            "support": make_peft_adapter(base, root / "support", seed=6, r=8, target_modules=["o_proj", "up_proj"])}
    home = root / "home"
    llm = tight_llm(tiny_llama_dir, home, **ENGINE_OPTIONS)
    settings = Settings(home=home, model=str(tiny_llama_dir), max_lora_rank=8, blob_gc_interval_seconds=0)
    url = settings.resolved_database_url()
    db.upgrade(url)
    registry = RegistryService.from_url(url)
    registry.create_tenant("acme")
    # an operator's cap and rate limits for the tenant on a shared server: a batch run of its own
    # must not 429 (a token limit of 1 would refuse every line)
    registry.update_tenant_settings("acme", {"max_concurrent_requests": 1, "max_requests_per_minute": 1,
                                             "max_tokens_per_minute": 1})
    manager = build_adapter_manager(settings, registry, llm.engine.runner.lora_target_spec())
    manager.upload("acme", "support", dirs["support"])
    manager.upload("acme", "sql-copy", dirs["sql"])  # the weights of --lora-modules sql, in the registry
    ctx = build_batch_context(settings, [LoraModule("sql", str(dirs["sql"]))], "acme",
                              engine=AsyncLLMEngine(llm.config, engine=llm.engine))
    server_llm = tight_llm(tiny_llama_dir, root / "srv-home", **ENGINE_OPTIONS)
    server_engine = AsyncLLMEngine(server_llm.config, engine=server_llm.engine)
    srv = start_server(root / "srv", server_engine)
    key = srv.make_tenant("acme")
    yield SimpleNamespace(ctx=ctx, base=base, dirs=dirs, srv=srv, key=key, model=ctx.served_model_name,
                          model_dir=tiny_llama_dir, tok=ctx.tokenizer)
    srv.stop()
    server_engine.shutdown()
    close_batch_context(ctx)


def run_batch(world, lines: list) -> list[dict]:
    """The result lines for ``lines`` (dicts are written as JSON, bytes as they are)."""
    data = b"\n".join(line if isinstance(line, bytes) else json.dumps(line).encode() for line in lines)
    out: list[dict] = []
    asyncio.run(run_lines(world.ctx, "acme", parse_lines(data), out.append, max_concurrency=8))
    return json.loads(json.dumps(out))  # as read back from the file


def server_answer(world, url: str, body: dict) -> tuple[int, dict]:
    with world.srv.tenant_client(world.key) as client:
        r = client.post(url, json=body)
    return r.status_code, r.json()


def without_ids(value):
    """``value`` without what differs between two answers of one body: ids and timestamps."""
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k not in ("id", "created", "created_at")}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


def assert_same_answer(ours: dict, theirs: tuple[int, dict], where: str = "") -> None:
    """Status and body equal, ids and timestamps aside; logprobs to float32 noise (the batch
    runs lines together, the server one at a time: other batch shapes round differently)."""
    status, body = theirs
    assert ours["status_code"] == status, where
    _assert_close(without_ids(ours["body"]), without_ids(body), where)


def _assert_close(a, b, where: str) -> None:
    if isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5), (where, a, b)
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), (where, a, b)
        for k in a:
            _assert_close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_close(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def token_ids(body: dict) -> list[int]:
    """The answer's tokens, from ``return_tokens_as_token_ids`` logprobs (chat or completion)."""
    choice = body["choices"][0]
    labels = [e["token"] for e in choice["logprobs"]["content"]] if "message" in choice else choice["logprobs"]["tokens"]
    return [int(label.removeprefix("token_id:")) for label in labels]


def chat_ids(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_lines_give_transformers_greedy_tokens_and_the_servers_answers(world):
    chat_bodies = [{"model": world.model, "messages": m, "logprobs": True, **GREEDY} for m in CHATS]
    completion_bodies = [{"model": world.model, "prompt": p, "logprobs": 0, **GREEDY} for p in PROMPTS]
    response_body = {"model": world.model, "input": "tell me", "max_output_tokens": N, "temperature": 0}
    constrained = {"model": world.model, "prompt": "pick", "temperature": 0, "max_tokens": N,
                   "structured_outputs": {"choice": ["yes", "no"]}}
    lines = [line(f"chat-{i}", "/v1/chat/completions", b) for i, b in enumerate(chat_bodies)]
    lines += [line(f"cmpl-{i}", "/v1/completions", b) for i, b in enumerate(completion_bodies)]
    lines.append(line("resp", "/v1/responses", response_body))
    lines.append(line("choice", "/v1/completions", constrained))
    results = run_batch(world, lines)
    assert results[-1]["response"]["body"]["choices"][0]["text"] in ("yes", "no")

    assert [r["custom_id"] for r in results] == [item["custom_id"] for item in lines]
    prompts = [chat_ids(world.tok, m) for m in CHATS] + [list(world.tok(p)["input_ids"]) for p in PROMPTS]
    expected = hf_greedy_all(world.model_dir, prompts, N)
    for result, prompt, ref in zip(results, prompts, expected):
        response = result["response"]
        assert result["error"] is None and response["status_code"] == 200, result
        assert response["request_id"] == response["body"]["id"]
        assert token_ids(response["body"]) == ref, result["custom_id"]
        assert response["body"]["usage"]["prompt_tokens"] == len(prompt)
    for item, result in zip(lines, results):
        assert_same_answer(result["response"], server_answer(world, item["url"], item["body"]), item["custom_id"])


def peft_greedy(world, adapter: str, prompt: list[int]) -> list[int]:
    model = peft_model_for(world.base, {adapter: world.dirs[adapter]})
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=2)
    return out[0, len(prompt):].tolist()


def test_adapter_lines_match_peft_from_lora_modules_and_the_tenants_registry(world):
    prompt = "SELECT the answer"
    bodies = {name: {"model": name, "prompt": prompt, "logprobs": 0, **GREEDY}
              for name in ("sql", "sql-copy", "support", "support@1", world.model)}
    results = run_batch(world, [line(name, "/v1/completions", body) for name, body in bodies.items()])
    ids = list(world.tok(prompt)["input_ids"])
    got = {r["custom_id"]: token_ids(r["response"]["body"]) for r in results}
    assert got["sql"] == got["sql-copy"] == peft_greedy(world, "sql", ids)
    assert got["support"] == got["support@1"] == peft_greedy(world, "support", ids)
    assert got[world.model] == hf_greedy_all(world.model_dir, [ids], N)[0]
    assert len({tuple(v) for v in got.values()}) == 3  # each adapter changes the output
    assert results[0]["response"]["body"]["model"] == "sql"
    manager = world.ctx.adapters.fallback  # each registry version acquired per line was given back
    assert all(manager.in_use(world.ctx.adapters.resolve("acme", name).content_hash) == 0
               for name in ("support", "sql-copy"))


def test_bad_lines_are_reported_and_the_good_ones_still_answered_in_order(world):
    good = {"model": world.model, "prompt": "fine", **GREEDY, "logprobs": 0}
    invalid = {"model": world.model, "prompt": "x", "temperature": "hot"}
    unknown_model = {"model": "nope", "prompt": "x"}
    lines = [
        line("good-1", "/v1/completions", good),
        b"this is not json",
        line("emb", "/v1/embeddings", {"model": world.model, "input": "x"}),
        line("streamed", "/v1/chat/completions", {"model": world.model, "messages": CHATS[0], "stream": True}),
        line("invalid", "/v1/completions", invalid),
        line("good-1", "/v1/completions", good),
        line("unknown", "/v1/completions", unknown_model),
        line("good-2", "/v1/chat/completions", {"model": world.model, "messages": CHATS[0], **GREEDY}),
    ]
    results = run_batch(world, lines)
    assert [r["custom_id"] for r in results] == ["good-1", None, "emb", "streamed", "invalid", "good-1", "unknown",
                                                "good-2"]
    assert [r["response"]["status_code"] if r["response"] else r["error"]["code"] for r in results] == [
        200, "invalid_json_line", "invalid_url", 400, 400, "duplicate_custom_id", 404, 200]
    assert results[1]["error"]["line"] == 2 and results[5]["error"]["line"] == 6
    assert results[3]["response"]["body"]["error"]["param"] == "stream"
    assert results[4]["response"]["body"]["error"]["param"] == "temperature"
    for index, body in ((4, invalid), (6, unknown_model), (0, good)):
        assert_same_answer(results[index]["response"], server_answer(world, "/v1/completions", body), str(index))
    assert world.ctx.engine.stats()["num_unfinished_requests"] == 0


@pytest.mark.slow
def test_the_command_line_end_to_end(world, tmp_path):
    lines = [
        line("chat", "/v1/chat/completions", {"model": world.model, "messages": CHATS[1], "logprobs": True, **GREEDY}),
        line("sql", "/v1/completions", {"model": "sql", "prompt": "SELECT 1", "logprobs": 0, **GREEDY}),
        b"{oops",
    ]
    data = b"\n".join(x if isinstance(x, bytes) else json.dumps(x).encode() for x in lines) + b"\n"
    out = tmp_path / "results.jsonl"
    home = tmp_path / "home"
    cmd = [sys.executable, "-m", "loraplex.cli", "run-batch", "-i", "-", "-o", str(out),
           "--model", str(world.model_dir), "--dtype", "float32", "--device", "cpu", "--home", str(home),
           "--kv-cache-bytes", str(4 << 20), "--max-lora-rank", "8", "--lora-modules", f"sql={world.dirs['sql']}"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run(cmd, input=data, capture_output=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()
    assert "3/3 lines done" in proc.stderr.decode()
    written = [json.loads(x) for x in out.read_text().splitlines()]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]  # the temporary file was renamed
    expected = run_batch(world, lines)  # in process, same lines
    assert [r["custom_id"] for r in written] == [r["custom_id"] for r in expected]
    assert written[2]["error"] == expected[2]["error"]
    for ours, theirs in zip(written[:2], expected[:2]):
        assert_same_answer(ours["response"], (theirs["response"]["status_code"], theirs["response"]["body"]))
    assert [r["response"]["status_code"] for r in written[:2]] == [200, 200]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_run_stopped_by_a_signal_leaves_no_output_and_no_partial_file(world, tmp_path, sig):
    """It left ``.results.jsonl.<random>.partial`` beside the target (SIGTERM), or two
    KeyboardInterrupt tracebacks (SIGINT)."""
    lines = [line(f"l{i}", "/v1/completions", {"model": world.model, "prompt": f"p{i}", "max_tokens": 200,
                                                "temperature": 0, "ignore_eos": True}) for i in range(2000)]
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    (tmp_path / "in.jsonl").write_bytes(data)
    out = tmp_path / "results.jsonl"
    cmd = [sys.executable, "-m", "loraplex.cli", "run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(out),
           "--model", str(world.model_dir), "--dtype", "float32", "--device", "cpu", "--home", str(tmp_path / "home"),
           "--kv-cache-bytes", str(4 << 20)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 120
    while not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]:  # the run is under way
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    time.sleep(1)  # the model loads or lines run (2,000 lines outlast it by far)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    assert "stopped by a signal; no output written" in err.decode() and b"Traceback" not in err, err.decode()
    assert [p.name for p in tmp_path.iterdir() if p.name != "home"] == ["in.jsonl"]  # no output, no partial
