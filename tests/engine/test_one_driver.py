"""An LLMEngine is stepped by one thread at a time (it has no locks): a second AsyncLLMEngine, or
the offline LLM.generate or LLM.beam_search, is refused while an AsyncLLMEngine runs on the same engine, and both
work again once it has shut down."""

from __future__ import annotations

import asyncio

import pytest

from loraplex import BeamSearchParams, SamplingParams
from loraplex.engine.async_engine import AsyncLLMEngine
from tests.engine.test_engine_exact import tight_llm

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, min_tokens=3)


def test_one_driver_at_a_time(tiny_llama_dir, loraplex_home):
    llm = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=64)
    expected = llm.generate([[5, 6, 7]], PARAMS)[0].token_ids
    first = AsyncLLMEngine(llm.config, engine=llm.engine)
    try:
        with pytest.raises(RuntimeError, match="already driven"):
            AsyncLLMEngine(llm.config, engine=llm.engine)
        with pytest.raises(RuntimeError, match="driven by a running AsyncLLMEngine"):
            llm.generate([[5, 6, 7]], PARAMS)
        with pytest.raises(RuntimeError, match="driven by a running AsyncLLMEngine"):
            llm.beam_search([{"prompt_token_ids": [5, 6, 7]}], BeamSearchParams(beam_width=2, max_tokens=2))
    finally:
        first.shutdown()
    assert llm.generate([[5, 6, 7]], PARAMS)[0].token_ids == expected
    second = AsyncLLMEngine(llm.config, engine=llm.engine)

    async def run():
        return [t async for d in second.generate([5, 6, 7], PARAMS) for t in d.outputs[0].token_ids]

    try:
        assert asyncio.run(run()) == expected
    finally:
        second.shutdown()
