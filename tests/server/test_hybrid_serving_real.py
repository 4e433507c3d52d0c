"""A model with layer groups through the server, in process: a tiny Qwen2 whose last two of three
layers slide (``use_sliding_window``, ``max_window_layers: 1``), so its pool holds a global and two
windowed groups. Greedy completions equal transformers' tokens; while requests run, ``/metrics``'
``vllm:kv_cache_usage_perc`` and ``/admin/v1/status``' block counts equal a recount of the pages
the running sequences' tables hold (every group's, windowed entries given back not counted); at
the end every page is free."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex.engine.async_engine import AsyncLLMEngine
from loraplex.engine.block_manager import FREED_BLOCK
from loraplex.engine.llm import LLM
from tests.engine.test_hybrid_kv_exact import page_bytes
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.lora.test_acceptance import greedy
from tests.server.conftest import start_server

WINDOW, BLOCK, MAX_TOKENS = 5, 4, 12


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid-serving")
    model_dir = make_tiny_model_dir(root / "qwen2-swa", "qwen2", seed=6, num_hidden_layers=3,
                                    use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=root / "home", block_size=BLOCK,
              kv_cache_bytes=80 * page_bytes(model_dir), max_num_batched_tokens=8, max_num_seqs=4)
    assert llm.engine.block_manager.group_windows == (None, WINDOW, WINDOW)
    engine = AsyncLLMEngine(llm.config, engine=llm.engine)
    srv = start_server(root / "srv", engine)
    yield srv, engine, srv.make_tenant("acme"), ref
    srv.stop()
    engine.shutdown()


def _pages_held(engine) -> int:
    held = {b for seq in engine.scheduler.running for table in seq.block_tables for b in table if b != FREED_BLOCK}
    return len(held)


def _metric(text: str, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M).group(1))


def test_completions_match_transformers_and_kv_usage_counts_held_pages(world):
    srv, async_engine, key, ref = world
    engine = async_engine.engine
    model = srv.app.state.ctx.served_model_name
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(4, 300, (n,), generator=gen).tolist() for n in (3, 17, 26)]
    # hold the engine thread after its 6th step, while the three sequences run, and look (the
    # stats the server shows are the snapshot the engine thread took then)
    paused, resume, steps = threading.Event(), threading.Event(), [0]
    step = engine.step

    def step_then_pause(*args, **kwargs):
        # all three requests in before the first step, however late their HTTP threads arrive
        # under load (the engine thread runs the queued adds between steps: this is that thread)
        deadline = time.monotonic() + 30
        while steps[0] == 0 and engine.scheduler.num_waiting < 3 and time.monotonic() < deadline:
            async_engine._run_commands()
            time.sleep(0.005)
        out = step(*args, **kwargs)
        steps[0] += 1
        if steps[0] == 6:
            async_engine._refresh_stats()  # the server reads the engine thread's last snapshot
            paused.set()
            resume.wait(30)
        return out

    engine.step = step_then_pause
    results: dict[int, list[int]] = {}

    def send(i: int) -> None:
        body = {"model": model, "prompt": prompts[i], "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}
        with srv.tenant_client(key) as c:
            r = c.post("/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        results[i] = [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    try:
        for t in threads:
            t.start()
        assert paused.wait(60)
        held = _pages_held(engine)
        assert held > 0 and engine.scheduler.num_running == 3
        total = engine.block_manager.num_blocks
        with srv.admin() as c:
            usage = _metric(c.get("/metrics").text, "vllm:kv_cache_usage_perc")
            status = c.get("/admin/v1/status").json()["engine"]
        assert usage == pytest.approx(held / total)
        assert (status["num_blocks_total"], status["num_blocks_free"]) == (total, total - held)
    finally:
        resume.set()
        for t in threads:
            t.join(60)
        engine.step = step
    assert [results[i] for i in range(len(prompts))] == [greedy(ref, p, MAX_TOKENS) for p in prompts]
    with srv.admin() as c:
        assert _metric(c.get("/metrics").text, "vllm:kv_cache_usage_perc") == 0.0
    assert engine.stats()["num_blocks_free"] == engine.block_manager.num_blocks
