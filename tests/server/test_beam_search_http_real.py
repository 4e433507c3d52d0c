"""vLLM's ``"use_beam_search": true`` on /v1/completions and /v1/chat/completions, through HTTP on
a real tiny engine: the n choices are the reference search's best beams (a naive vLLM-semantics
search over the transformers model, with the PEFT adapter for an adapter model), streamed or
not; usage counts the prompt once and the returned beams' tokens; fields the search does not
apply are a 400 naming them and run nothing; a client that goes away stops the whole search
and gives everything back."""

from __future__ import annotations

import io
import json
import time

import pytest
import torch

from loraplex.engine.async_engine import AsyncLLMEngine
from tests.engine.beam_reference import make_eos_prone_model_dir, naive_vllm_beam_search
from tests.server.conftest import start_server
from tests.server.test_disconnect_fake import _raw_request, _wait

PROMPT = list(range(10, 180, 10))  # finishes beams on EOS within a few tokens
FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from loraplex import LLM
    from loraplex.registry.adapter_manager import AdapterManager
    from loraplex.storage.base import open_blob_store
    from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for

    root = tmp_path_factory.mktemp("beam-http")
    model_dir = make_eos_prone_model_dir(root / "model")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    adapter_dir = make_peft_adapter(hf, root / "sql", seed=5, target_modules=["q_proj", "v_proj", "down_proj"])
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=root / "home", block_size=16,
              max_num_seqs=16, max_num_batched_tokens=256, max_loras=2, max_lora_rank=8)
    engine = AsyncLLMEngine(llm.config, engine=llm.engine)

    def adapters(registry, home):
        return AdapterManager(registry, open_blob_store(str(home / "blobs")),
                              AdapterManager.make_disk_cache(home / "adapter-cache", 1 << 30),
                              llm.engine.runner.lora_target_spec(), 8)

    srv = start_server(root / "srv", engine, adapters, model=str(model_dir))
    key = srv.make_tenant("acme")
    files = {f: (f, io.BytesIO((adapter_dir / f).read_bytes())) for f in FILES}
    with srv.admin() as c:
        assert c.post("/admin/v1/tenants/acme/adapters/sql/versions", files=files).status_code in (200, 201)
    refs = {None: hf, "sql": peft_model_for(hf, {"sql": adapter_dir})}
    yield srv, key, llm.engine, refs
    srv.stop()
    engine.shutdown()


def _model(srv, adapter):
    return srv.app.state.ctx.served_model_name if adapter is None else adapter


def _expected(refs, adapter, prompt, width, max_tokens, length_penalty=1.0):
    return naive_vllm_beam_search(refs[adapter], prompt, width, max_tokens, length_penalty=length_penalty)


def _idle(engine) -> bool:
    s = engine.stats()
    return s["num_unfinished_requests"] == 0 and s["num_blocks_free"] == s["num_blocks_total"]


@pytest.mark.parametrize("adapter", [None, "sql"])
def test_completions_return_the_best_beams(world, adapter):
    srv, key, engine, refs = world
    tok = srv.app.state.ctx.tokenizer
    body = {"model": _model(srv, adapter), "prompt": PROMPT, "use_beam_search": True, "n": 3, "max_tokens": 6,
            "length_penalty": 0.5, "temperature": 0.8, "top_p": 1.0}  # neutral sampling fields are fine
    with srv.tenant_client(key) as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    expected = _expected(refs, adapter, PROMPT, 3, 6, 0.5)
    choices = sorted(r.json()["choices"], key=lambda ch: ch["index"])
    returned = [gen[:-1] if eos else gen for gen, _, eos in expected]  # the EOS is not returned
    assert [ch["text"] for ch in choices] == [tok.decode(ids) for ids in returned]
    assert [ch["finish_reason"] for ch in choices] == ["stop" if eos else "length" for _, _, eos in expected]
    if adapter is None:  # this prompt finishes beams on EOS on the base model
        assert "stop" in {ch["finish_reason"] for ch in choices}
    assert r.json()["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": sum(map(len, returned)),
                                 "total_tokens": len(PROMPT) + sum(map(len, returned))}
    _wait(lambda: _idle(engine), 2.0)


def test_each_prompt_of_a_list_gets_its_own_n_beams(world):
    srv, key, engine, refs = world
    tok = srv.app.state.ctx.tokenizer
    prompts = [PROMPT, [5, 6, 7]]
    body = {"model": _model(srv, None), "prompt": prompts, "use_beam_search": True, "n": 2, "max_tokens": 4}
    with srv.tenant_client(key) as c:
        r = c.post("/v1/completions", json=body)
    choices = sorted(r.json()["choices"], key=lambda ch: ch["index"])
    expected = [tok.decode(gen[:-1] if eos else gen) for p in prompts for gen, _, eos in _expected(refs, None, p, 2, 4)]
    assert [ch["text"] for ch in choices] == expected


def test_include_stop_str_counts_the_eos_token(world):
    srv, key, engine, refs = world
    body = {"model": _model(srv, None), "prompt": PROMPT, "use_beam_search": True, "n": 3, "max_tokens": 6,
            "include_stop_str_in_output": True}
    with srv.tenant_client(key) as c:
        r = c.post("/v1/completions", json=body)
    expected = _expected(refs, None, PROMPT, 3, 6)
    assert r.json()["usage"]["completion_tokens"] == sum(len(gen) for gen, _, _ in expected)


def test_chat_beams_stream_as_vllm_streams_them(world):
    srv, key, engine, refs = world
    tok = srv.app.state.ctx.tokenizer
    messages = [{"role": "user", "content": "name a colour"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = list(tok(prompt, add_special_tokens=False)["input_ids"])
    expected = _expected(refs, "sql", ids, 2, 5)
    texts = [tok.decode(gen[:-1] if eos else gen) for gen, _, eos in expected]
    body = {"model": "sql", "messages": messages, "use_beam_search": True, "n": 2, "max_completion_tokens": 5}
    with srv.tenant_client(key) as c:
        whole = c.post("/v1/chat/completions", json=body)
        streamed = c.post("/v1/chat/completions", json={**body, "stream": True,
                                                         "stream_options": {"include_usage": True}})
    assert whole.status_code == 200, whole.text
    choices = sorted(whole.json()["choices"], key=lambda ch: ch["index"])
    assert [ch["message"]["content"] for ch in choices] == texts
    got, finishes, usage = {}, {}, None
    for line in streamed.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for ch in chunk["choices"]:
            got[ch["index"]] = got.get(ch["index"], "") + (ch["delta"].get("content") or "")
            finishes[ch["index"]] = ch.get("finish_reason") or finishes.get(ch["index"])
        usage = chunk.get("usage") or usage
    assert [got[i] for i in range(2)] == texts
    assert [finishes[i] for i in range(2)] == [ch["finish_reason"] for ch in choices]
    assert usage == whole.json()["usage"]


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/completions", {"logprobs": 2}, "logprobs"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"stop": ["x"]}, "stop"),
    ("/v1/completions", {"top_p": 0.5}, "top_p"),
    ("/v1/completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ("/v1/completions", {"early_stopping": True}, "early_stopping"),
    ("/v1/completions", {"n": 11}, "n"),  # 22 candidates per beam > --max-logprobs 20
    ("/v1/completions", {"use_beam_search": "yes"}, "use_beam_search"),
    ("/v1/completions", {"length_penalty": "long"}, "length_penalty"),
    ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
     "tools"),
])
def test_what_beam_search_does_not_apply_is_a_400(world, path, extra, param):
    srv, key, engine, _ = world
    before = engine.stats()["num_requests_finished"]
    body = {"model": _model(srv, None), "use_beam_search": True, "n": 2, "max_tokens": 3, **extra}
    body.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    with srv.tenant_client(key) as c:
        r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert engine.stats()["num_requests_finished"] == before  # nothing ran


def _limited_tenant(srv, name: str, tpm: int) -> str:
    key = srv.make_tenant(name)
    with srv.admin() as c:
        assert c.patch(f"/admin/v1/tenants/{name}", json={"max_tokens_per_minute": tpm}).status_code == 200
    return key


def _assert_used(ctx, tenant: str, expected: int, since: float, tpm: int) -> None:
    """The tenant's token bucket holds ``expected`` less what refilled since ``since``."""
    used = ctx.rate_limiter.used(tenant, "tokens")
    assert expected - (time.monotonic() - since) * tpm / 60 - 1e-6 <= used <= expected


def test_usage_and_rate_limits_count_the_returned_beams_once(world):
    srv, _, engine, refs = world
    ctx = srv.app.state.ctx
    key = _limited_tenant(srv, "bill", 600)  # refills 10 tokens a second
    body = {"model": _model(srv, None), "prompt": PROMPT, "use_beam_search": True, "n": 3, "max_tokens": 6}
    start = time.monotonic()
    with srv.tenant_client(key) as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    expected = _expected(refs, None, PROMPT, 3, 6)
    completion = sum(len(gen) - eos for gen, _, eos in expected)
    assert r.json()["usage"]["completion_tokens"] == completion
    # the reservation (prompt + n x max_tokens) gave back what the returned beams did not use
    _assert_used(ctx, "bill", len(PROMPT) + completion, start, 600)
    assert ctx.usage.flush()
    totals = srv.registry.usage_report(tenant="bill").totals
    assert (totals["requests"], totals["prompt_tokens"], totals["completion_tokens"]) == (1, len(PROMPT), completion)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_stops_the_search(world, stream):
    srv, _, engine, _ = world
    ctx = srv.app.state.ctx
    tenant = f"gone{int(stream)}"
    key = _limited_tenant(srv, tenant, 6000)  # room for 4 x 900 tokens
    body = json.dumps({"model": _model(srv, None), "prompt": PROMPT, "use_beam_search": True, "n": 4,
                       "max_tokens": 900, "ignore_eos": True, "stream": stream}).encode()
    steps = engine.stats()["num_steps"]
    start = time.monotonic()
    sock = _raw_request(srv.url, "/v1/completions", key, body)
    _wait(lambda: engine.stats()["num_steps"] > steps + 20, 10.0)  # the search is well under way
    sock.close()
    _wait(lambda: _idle(engine), 2.0)
    _wait(lambda: ctx.limiter.in_flight() == 0 and ctx.lifecycle.in_flight == 0, 2.0)
    stopped_at = engine.stats()["num_steps"]
    time.sleep(0.3)
    assert engine.stats()["num_steps"] == stopped_at  # no step request comes after the disconnect
    assert stopped_at - steps < 900  # the search (900 steps) was cut short
    _assert_used(ctx, tenant, len(PROMPT), start, 6000)  # the unused reservation came back
    assert ctx.usage.flush()
    totals = srv.registry.usage_report(tenant=tenant).totals
    assert (totals["requests"], totals["failed_requests"], totals["failed_prompt_tokens"]) == (0, 1, len(PROMPT))


@pytest.mark.parametrize("length_penalty", [1000.0, -1000.0])
def test_an_extreme_length_penalty_is_answered(world, length_penalty):
    """``length ** length_penalty`` past the float range (vLLM's formula raises there) still
    ranks the beams: a 200 with n choices, the search's blocks all given back."""
    srv, key, engine, refs = world
    body = {"model": _model(srv, None), "prompt": PROMPT, "use_beam_search": True, "n": 2, "max_tokens": 4,
            "length_penalty": length_penalty}
    with srv.tenant_client(key) as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert sorted(ch["index"] for ch in r.json()["choices"]) == [0, 1]
    _wait(lambda: _idle(engine), 2.0)
