"""A request naming a new adapter version has its files read and validated off the engine
thread (the engine keeps stepping other requests meanwhile), and still runs with exactly that
adapter; a bad adapter fails the request before the engine sees it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.engine.async_engine import AsyncLLMEngine
from loraplex.lora.errors import InvalidAdapterError
from tests.fixtures.peft_adapters import make_peft_adapter
from tests.lora.adapter_edits import BAD_ADAPTERS


def test_new_adapter_is_read_off_the_engine_thread(tiny_llama_dir, loraplex_home, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    adapter = make_peft_adapter(base, tmp_path / "fresh", seed=5, r=4, lora_alpha=8)
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", home=loraplex_home, kv_cache_bytes=8 << 20,
              max_loras=2, max_lora_rank=8, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = llm.generate([[3, 4, 5]], params, adapters=[str(adapter)])[0].token_ids
    fresh_llm = LLM(model=str(tiny_llama_dir), dtype="float32", home=loraplex_home, kv_cache_bytes=8 << 20,
                    max_loras=2, max_lora_rank=8, max_num_seqs=8)
    manager = fresh_llm.engine.lora_manager
    parse = manager.catalog.parse
    reading_threads: list[str] = []
    steps_during_read: list[int] = []

    def slow_parse(path, expected_id=None):
        reading_threads.append(threading.current_thread().name)
        before = fresh_llm.engine.scheduler.stats.num_steps
        time.sleep(0.5)  # as if the adapter were large: the engine must keep serving the base request
        steps_during_read.append(fresh_llm.engine.scheduler.stats.num_steps - before)
        return parse(path, expected_id)

    monkeypatch.setattr(manager.catalog, "parse", slow_parse)
    aengine = AsyncLLMEngine(fresh_llm.config, engine=fresh_llm.engine)

    async def run(prompt, adapter_ref, max_tokens):
        tokens = []
        async for delta in aengine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                   ignore_eos=True), adapter=adapter_ref):
            tokens += delta.outputs[0].token_ids
        return tokens

    async def main():
        base_task = asyncio.create_task(run([7, 8, 9], None, 300))
        await asyncio.sleep(0.05)
        got = await run([3, 4, 5], str(adapter), 6)
        base_tokens = await base_task
        with pytest.raises(InvalidAdapterError, match=BAD_ADAPTERS["nan"][1]):
            await run([3, 4], str(BAD_ADAPTERS["nan"][0](adapter, tmp_path / "bad")), 2)
        return got, base_tokens

    try:
        got, base_tokens = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert got == expected and len(base_tokens) == 300
    assert reading_threads and "loraplex-engine" not in reading_threads
    assert steps_during_read[0] > 0  # the base request kept decoding while the adapter was read
