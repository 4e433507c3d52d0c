"""``AsyncLLMEngine``'s shutdown parts on the real tiny engine. ``fail_all_requests``, the cut: every
request still open ends with the given error, raised in its stream after the deltas it had, both
those that run and one whose stream was not read yet (still prepared); every KV block is free
afterwards, and the engine goes on serving (the cut is not a state it stays in)."""

from __future__ import annotations

import asyncio

import pytest

from loraplex import SamplingParams
from loraplex.engine.async_engine import AsyncLLMEngine
from tests.engine.test_engine_exact import tight_llm

LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


class Cut(Exception):
    pass


@pytest.fixture
def engine(tiny_llama_dir, loraplex_home):
    llm = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=96, max_num_batched_tokens=256)
    engine = AsyncLLMEngine(llm.config, engine=llm.engine)
    try:
        yield engine
    finally:
        engine.shutdown()


async def _read_until_error(stream) -> tuple[int, BaseException | None]:
    """Tokens read, and what the stream raised (None when it finished)."""
    tokens = 0
    try:
        async for out in stream:
            tokens += sum(len(c.token_ids) for c in out.outputs)
    except Cut as exc:
        return tokens, exc
    return tokens, None


def test_every_open_request_ends_with_the_error_and_frees_its_blocks(engine):
    error = Cut("the server is shutting down")

    async def main():
        running = [engine.generate([5 + i, 6, 7, 8, 9, 10], LONG, request_id=f"run{i}") for i in range(3)]
        firsts = [await stream.__anext__() for stream in running]  # each is in the engine and has run
        unread = engine.generate([11, 12, 13], LONG, request_id="unread")  # still prepared
        ended = await engine.fail_all_requests(error)
        results = await asyncio.gather(*(_read_until_error(s) for s in [*running, unread]))
        after = [out async for out in engine.generate([5, 6, 7], SHORT, request_id="after")]
        return firsts, ended, results, after

    firsts, ended, results, after = asyncio.run(main())
    assert all(len(f.outputs[0].token_ids) == 1 for f in firsts)
    assert ended == 4
    for tokens, raised in results:
        assert raised is error
        assert tokens < LONG.max_tokens - 1  # cut short, not run to the end
    assert results[3][0] == 0  # the unread one never produced a token
    assert after[-1].finished and after[-1].outputs[0].finish_reason == "length"
    assert sum(len(c.token_ids) for out in after for c in out.outputs) == SHORT.max_tokens
    stats = engine.stats()
    assert stats["num_unfinished_requests"] == 0
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    assert engine._preparing == {}


def test_with_nothing_open_it_ends_nothing(engine):
    async def main():
        done = [out async for out in engine.generate([5, 6, 7], SHORT, request_id="done")]
        return done, await engine.fail_all_requests(Cut("x"))

    done, ended = asyncio.run(main())
    assert done[-1].outputs[0].finish_reason == "length"
    assert ended == 0


def test_shutdown_waits_for_the_grammar_warm_thread(engine, monkeypatch):
    """No native tokenizer build may still run while the interpreter exits (a daemon thread
    there can crash the process): ``shutdown`` joins the thread ``warm_grammars`` started."""
    import threading
    import time

    started, finished = threading.Event(), threading.Event()

    def slow_warm():
        started.set()
        time.sleep(0.4)
        finished.set()

    monkeypatch.setattr(engine.engine.grammars, "warm", slow_warm)
    engine.warm_grammars()
    assert started.wait(5)
    engine.shutdown()
    assert finished.is_set()
    assert not engine._grammar_warm.is_alive()
