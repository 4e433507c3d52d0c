"""``AsyncLLMEngine.generate``: an abort counts from the call on, before the returned stream is
first read (an async generator's body starts only then, some event-loop ticks later). On the real
tiny engine: the stream then ends at once as an abort with no token, the request never runs,
and a stream never read leaves nothing behind once collected."""

from __future__ import annotations

import asyncio
import gc

import pytest

from loraplex import SamplingParams
from loraplex.engine.async_engine import AsyncLLMEngine
from tests.engine.test_engine_exact import tight_llm

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def engine(tiny_llama_dir, loraplex_home):
    llm = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=64, max_num_batched_tokens=256)
    engine = AsyncLLMEngine(llm.config, engine=llm.engine)
    try:
        yield engine
    finally:
        engine.shutdown()


async def _read(stream) -> list:
    return [out async for out in stream]


def test_an_abort_before_the_stream_is_read_ends_it_unrun(engine):
    async def main():
        aborted = engine.generate([5, 6, 7, 8, 9], PARAMS, request_id="early")
        kept = engine.generate([5, 6, 7, 8, 9], PARAMS, request_id="kept")
        engine.abort("early")
        await engine._call(lambda: None)  # the abort is applied on the engine thread before either body starts
        return await _read(aborted), await _read(kept)

    before = engine.stats()["prompt_tokens_total"]
    aborted, kept = asyncio.run(main())
    assert len(aborted) == 1 and aborted[0].finished
    assert [(c.finish_reason, c.token_ids) for c in aborted[0].outputs] == [("abort", [])]
    assert sum(len(c.token_ids) for out in kept for c in out.outputs) == PARAMS.max_tokens
    assert kept[-1].outputs[0].finish_reason == "length"
    stats = engine.stats()
    assert stats["num_unfinished_requests"] == 0
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    assert stats["prompt_tokens_total"] - before == 5  # the kept one's: the aborted one never ran
    assert engine._preparing == {}


def test_a_stream_never_read_leaves_no_mark(engine):
    async def main():
        stream = engine.generate([5, 6, 7], PARAMS, request_id="unread")
        assert "unread" in engine._preparing
        del stream
        gc.collect()
        # and a later request of the same id is not aborted by an abort meant for the dropped one
        engine.abort("unread")
        await engine._call(lambda: None)  # applied (and dropped: no such request) before the next call
        return await _read(engine.generate([5, 6, 7], PARAMS, request_id="unread"))

    outs = asyncio.run(main())
    assert outs[-1].outputs[0].finish_reason == "length"
    assert engine._preparing == {}
    assert engine.stats()["num_unfinished_requests"] == 0
