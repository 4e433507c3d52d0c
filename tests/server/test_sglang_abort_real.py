"""SGLang's ``POST /abort_request`` on the real engine (tiny Llama, CPU, a PEFT adapter behind the
real AdapterManager): with one sequence at a time, a running stream on the adapter and a request
queued behind it are aborted by ``rid``; each ends as SGLang ends an aborted output (the running
one with the greedy tokens it had, equal to the completions route's for as many tokens), and
afterwards every KV block is free, no request is left and the adapter is held by none."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from starlette.testclient import TestClient

from loraplex.engine.async_engine import AsyncLLMEngine
from loraplex.server.app import create_app
from tests.engine.test_engine_exact import tight_llm
from tests.fixtures.peft_adapters import make_peft_adapter
from tests.server.registry_stack import registry_stack

ADMIN_KEY = "sglang-abort-admin-key"
FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(scope="module")
def world(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("sglang-abort")
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    adapter = make_peft_adapter(base, root / "sql", seed=5, r=4, target_modules=["q_proj", "v_proj"])
    home = root / "home"
    llm = tight_llm(tiny_llama_dir, home, num_blocks=128, max_num_batched_tokens=256, max_num_seqs=1,
                    max_loras=2, max_lora_rank=8)
    engine = AsyncLLMEngine(llm.config, engine=llm.engine)
    settings, registry, manager, key = registry_stack(home, llm, tiny_llama_dir, ADMIN_KEY)
    try:
        with TestClient(create_app(settings, engine=engine, registry=registry, adapters=manager)) as client:
            r = client.post("/admin/v1/tenants/acme/adapters/sql/versions",
                            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                            files={n: (n, (adapter / n).read_bytes()) for n in FILES})
            assert r.status_code == 201, r.text
            client.headers["Authorization"] = f"Bearer {key}"
            yield client, engine, r.json()["sha256"]
    finally:
        engine.shutdown()


def _wait(engine, **want) -> None:
    deadline = time.monotonic() + 20
    while any(engine.stats().get(k) != v for k, v in want.items()):
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.01)


def test_abort_frees_blocks_and_the_adapter(world):
    client, engine, sha = world
    body = {"text": "one two three", "lora_path": "sql", "sampling_params": {"max_new_tokens": 900, "temperature": 0,
                                                                            "ignore_eos": True}}
    queued = {}
    with client.stream("POST", "/generate", json={**body, "rid": "running", "stream": True}) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        t = threading.Thread(target=lambda: queued.update(r=client.post("/generate", json={**body, "rid": "queued"})))
        t.start()
        _wait(engine, num_requests_running=1, num_requests_waiting=1)  # one sequence at a time
        r_abort = client.post("/abort_request", json={"rid": "queued"})
        assert r_abort.status_code == 200 and r_abort.content == b""
        t.join(20)
        assert client.post("/abort_request", json={"rid": "running"}).status_code == 200
        rest = list(lines)
    q = queued["r"]
    assert q.status_code == 200, q.text
    assert q.json()["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert q.json()["output_ids"] == []
    assert [x for x in rest if x.startswith("data: ")][-1] == "data: [DONE]"
    last = json.loads([x for x in rest if x.startswith("data: {")][-1][6:])
    assert last["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None,
                                                 "err_type": None}
    n = len(last["output_ids"])
    assert 0 < n < 900
    ref = client.post("/v1/completions", json={"model": "sql", "prompt": "one two three", "max_tokens": n,
                                                "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert ref.json()["choices"][0]["token_ids"] == last["output_ids"]  # the greedy tokens, up to the abort
    _wait(engine, num_unfinished_requests=0)
    stats = engine.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    assert stats["lora"]["adapters"][sha]["outstanding_requests"] == 0
    assert client.app.state.ctx.adapters.stats()["in_use"] == {}


def test_abort_while_the_request_is_prepared_is_not_lost(world, monkeypatch):
    """An abort that comes while the engine request is still being prepared (its grammar
    compiled off the engine thread, as a new adapter version is read) ends it as a queued
    abort: the engine had no such request yet, so the abort was dropped and the request then
    ran to its end, its full output answered as if never aborted."""
    client, engine, sha = world
    compiling, release = threading.Event(), threading.Event()
    grammars = engine.engine.grammars
    real = grammars.matcher

    def slow_matcher(spec):
        compiling.set()
        assert release.wait(20)
        return real(spec)

    monkeypatch.setattr(grammars, "matcher", slow_matcher)
    body = {"text": "one two three", "lora_path": "sql", "rid": "preparing",
            "sampling_params": {"max_new_tokens": 40, "temperature": 0, "regex": "[a-z ]+"}}
    got = {}
    t = threading.Thread(target=lambda: got.update(r=client.post("/generate", json=body)))
    t.start()
    try:
        assert compiling.wait(20)
        assert client.post("/abort_request", json={"rid": "preparing"}).status_code == 200
    finally:
        release.set()
    t.join(20)
    r = got["r"]
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert r.json()["output_ids"] == []
    _wait(engine, num_unfinished_requests=0)
    stats = engine.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    assert client.app.state.ctx.adapters.stats()["in_use"] == {}


def _sse_outputs(text: str) -> dict[int, dict]:
    """The last event of each output index of an SGLang batch stream."""
    last: dict[int, dict] = {}
    for line in text.splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[len("data: "):])
            last[event["index"]] = event
    return last


@pytest.mark.parametrize("stream", [False, True])
def test_abort_before_the_engine_requests_are_read_is_not_lost(world, monkeypatch, stream):
    """An /abort_request that comes once the call can be found but before its outputs are read
    (the response's body and each group's pump start ticks later) ends the aborted prompt as a
    queued abort and only it; the engine had no request of that id yet, so the abort was
    dropped and the prompt ran to its end. Done here at once after the call is tracked, the
    earliest an /abort_request can see it."""
    from loraplex.server.sglang_abort import abort_outputs

    client, engine, _ = world
    ctx = client.app.state.ctx
    real_track = ctx.sglang_calls.track

    def track_then_abort(tenant, outputs):
        real_track(tenant, outputs)
        assert abort_outputs(ctx.engine, outputs, "early-b") == 1
        # the engine thread takes commands in order: once this one ran, so did the abort, all
        # before any prompt's generate body can start (the event loop is held here)
        applied = threading.Event()
        engine._submit(applied.set, lambda exc: None)
        assert applied.wait(20)

    monkeypatch.setattr(ctx.sglang_calls, "track", track_then_abort)
    body = {"text": ["one two three", "four five six", "seven eight"], "rid": ["early-a", "early-b", "early-c"],
            "stream": stream, "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    outs = list(_sse_outputs(r.text).values()) if stream else r.json()
    by_rid = {o["meta_info"]["id"]: o for o in outs}
    assert set(by_rid) == {"early-a", "early-b", "early-c"}
    assert by_rid["early-b"]["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert by_rid["early-b"]["output_ids"] == []
    for rid in ("early-a", "early-c"):
        assert by_rid[rid]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}, by_rid[rid]
        assert len(by_rid[rid]["output_ids"]) == 5
    _wait(engine, num_unfinished_requests=0)
    stats = engine.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    assert engine._preparing == {}
