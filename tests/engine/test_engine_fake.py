"""LLMEngine and AsyncLLMEngine over the fake paged runner: request handling, detokenization,
stop strings, errors, aborts and streaming. The model itself is tested in test_engine_exact."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from loraplex.config import EngineConfig
from loraplex.engine.async_engine import AsyncLLMEngine
from loraplex.engine.llm_engine import LLMEngine
from loraplex.sampling_params import InvalidRequestError, SamplingParams
from tests.engine.scheduler_harness import FakeModelRunner, reference_output


def make_engine(**config) -> LLMEngine:
    runner_kw = {k: config.pop(k) for k in ("num_blocks", "max_model_len") if k in config}
    runner = FakeModelRunner(block_size=4, **runner_kw)
    return LLMEngine(EngineConfig(block_size=4, **config), runner=runner)


def run_all(engine: LLMEngine) -> dict:
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, **kw)


def test_outputs_text_and_blocks():
    rng = random.Random(0)
    engine = make_engine(max_num_batched_tokens=16, num_blocks=30)
    prompts = [[rng.randrange(4, 97) for _ in range(rng.randint(1, 40))] for _ in range(10)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(max_tokens=12))
    finals = run_all(engine)
    tok = engine.tokenizer
    for i, p in enumerate(prompts):
        out = finals[f"r{i}"]
        assert out.token_ids == reference_output(p, 12)
        assert out.prompt_token_ids == p
        assert out.finish_reason == "length"
        full = tok.decode(out.token_ids, skip_special_tokens=True)
        # incremental decoding gives the same text (a trailing split character may be held)
        assert full.startswith(out.text) and len(full) - len(out.text) <= 1
    stats = engine.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0


def test_string_prompt_is_tokenized():
    engine = make_engine()
    engine.add_request("a", "hello", greedy(max_tokens=3))
    out = run_all(engine)["a"]
    assert out.prompt_token_ids == list(engine.tokenizer("hello")["input_ids"])
    assert out.prompt == "hello"
    assert out.token_ids == reference_output(out.prompt_token_ids, 3)


def _find_stop_case(engine, max_tokens=30):
    """A prompt whose reference output has a decodable 2-char substring to use as stop string."""
    tok = engine.tokenizer
    for seed in range(200):
        rng = random.Random(seed)
        prompt = [rng.randrange(4, 97) for _ in range(5)]
        ref = reference_output(prompt, max_tokens)
        if any(t < 4 for t in ref):
            continue
        text = tok.decode(ref, skip_special_tokens=True)
        if len(text) >= 12 and "\ufffd" not in text:
            stop = text[6:8]
            if text.find(stop) == 6:
                return prompt, ref, text, stop
    pytest.fail("no stop-string case found")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cut_and_never_streamed(include):
    engine = make_engine()
    prompt, ref, text, stop = _find_stop_case(engine)
    params = greedy(max_tokens=30, stop=[stop], include_stop_str_in_output=include)
    engine.add_request("s", prompt, params, stream_deltas=True)
    streamed = ""
    finals = []
    while engine.has_unfinished():
        for out in engine.step():
            streamed += out.outputs[0].text
            assert stop not in streamed or (include and streamed.endswith(stop))
            if out.finished:
                finals.append(out)
    expected = text[:8] if include else text[:6]
    assert streamed == expected
    assert finals[0].outputs[0].finish_reason == "stop"
    assert finals[0].outputs[0].stop_reason == stop
    assert engine.stats()["num_blocks_free"] == engine.stats()["num_blocks_total"]


def test_bad_requests_rejected_without_disturbing_others():
    engine = make_engine(max_model_len=64)
    engine.add_request("good", [5, 6, 7], greedy(max_tokens=8))
    engine.step()
    bad_max = greedy(max_tokens=4)
    bad_max.max_tokens = 0
    cases = [
        ([], greedy(), "prompt"),
        ("", greedy(), "prompt"),
        ([5] * 64, greedy(), "prompt"),
        ([5, 1000], greedy(), "prompt"),
        ([5], bad_max, "max_tokens"),
    ]
    for prompt, params, param in cases:
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request(None, prompt, params)
        assert info.value.param == param
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("good", [5], greedy())
    assert info.value.param == "request_id"
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("x", [5], greedy(), adapter="some-adapter")
    assert info.value.param == "adapter"
    assert engine.num_unfinished_requests == 1
    out = run_all(engine)["good"]
    assert out.token_ids == reference_output([5, 6, 7], 8)


def test_n_sequences_and_abort_frees_blocks():
    engine = make_engine(num_blocks=64)
    engine.add_request("multi", [9, 9], greedy(max_tokens=20, n=3))
    engine.add_request("long", list(range(4, 40)), greedy(max_tokens=100))
    for _ in range(6):
        engine.step()
    held_by_long = len(engine.scheduler.running[-1].block_table)
    assert engine.scheduler.running[-1].request_id == "long" and held_by_long >= 9
    used = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
    final = engine.abort("long")
    assert final.finished and final.finish_reason == "abort"
    assert engine.block_manager.num_blocks - engine.block_manager.num_free_blocks == used - held_by_long
    out = run_all(engine)["multi"]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == reference_output([9, 9], 20) for c in out.outputs)
    assert engine.stats()["num_blocks_free"] == 64
    assert engine.abort("long") is None


DROPPED_MAX_TOKENS = 3000


def test_async_two_streams_abort_one():
    # the dropped request asks for far more tokens than the consumer reads: the engine thread
    # (holding the GIL between steps) must not be able to finish it before the consumer closes
    # it, as 200 fake tokens sometimes did on a loaded CI machine
    engine = make_engine(num_blocks=1024, max_model_len=4096)
    aengine = AsyncLLMEngine(engine.config, engine=engine)

    async def consume(request_id, prompt, max_tokens, stop_after=None):
        tokens, text, n = [], "", 0
        gen = aengine.generate(prompt, greedy(max_tokens=max_tokens), request_id=request_id)
        async for delta in gen:
            n += 1
            tokens += delta.outputs[0].token_ids
            text += delta.outputs[0].text
            last = delta
            if stop_after is not None and len(tokens) >= stop_after:
                await gen.aclose()  # the consumer walks away: the request is aborted
                return tokens, text, None, n
        return tokens, text, last, n

    async def main():
        loop = asyncio.get_running_loop()
        ticks = 0

        async def ticker():  # the event loop keeps running while steps happen
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        t = loop.create_task(ticker())
        keep, dropped = await asyncio.gather(
            consume("keep", [10, 11, 12], 40), consume("drop", list(range(4, 30)), DROPPED_MAX_TOKENS, stop_after=3)
        )
        t.cancel()
        with pytest.raises(InvalidRequestError):
            async for _ in aengine.generate([], greedy()):
                pass
        for _ in range(200):
            if aengine.stats()["num_unfinished_requests"] == 0:
                break
            await asyncio.sleep(0.01)
        return keep, dropped, ticks

    try:
        keep, dropped, ticks = asyncio.run(main())
    finally:
        aengine.shutdown()
    tokens, text, last, n = keep
    assert tokens == reference_output([10, 11, 12], 40)
    assert last.finished and last.outputs[0].finish_reason == "length"
    assert n > 1  # streamed in pieces
    full = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    assert full.startswith(text) and len(full) - len(text) <= 1
    assert 3 <= len(dropped[0]) < DROPPED_MAX_TOKENS
    stats = aengine.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    assert stats["num_requests_aborted"] == 1
    assert ticks > 0


def test_async_abort_by_id_ends_stream_with_abort():
    engine = make_engine(num_blocks=64)
    # After the first step, hold each step until the abort was sent: otherwise the fake runner
    # can reach max_model_len before a loaded machine delivers the first delta to the consumer.
    abort_sent = threading.Event()
    execute = engine.runner.execute
    num_steps = [0]

    def gated_execute(sched_out):
        num_steps[0] += 1
        if num_steps[0] > 1:
            assert abort_sent.wait(30)
        return execute(sched_out)

    engine.runner.execute = gated_execute
    aengine = AsyncLLMEngine(engine.config, engine=engine)

    async def main():
        reasons = []
        async for delta in aengine.generate([7, 8], greedy(max_tokens=500), request_id="x"):
            if delta.outputs[0].token_ids and len(reasons) == 0:
                aengine.abort("x")
                abort_sent.set()
            reasons.append(delta.outputs[0].finish_reason)
        return reasons

    try:
        reasons = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert reasons[-1] == "abort" and len(reasons) < 100


def test_async_cancelled_consumer_aborts_and_duplicate_id_is_refused():
    # far more tokens than the engine thread can make before the consumer is cancelled (1900
    # fake tokens were sometimes all made first on a loaded CI machine: nothing left to abort)
    engine = make_engine(num_blocks=5000, max_model_len=20000)
    aengine = AsyncLLMEngine(engine.config, engine=engine)

    async def consume(request_id):
        async for _ in aengine.generate([7, 8], greedy(max_tokens=19000), request_id=request_id):
            await asyncio.sleep(0)

    async def main():
        task = asyncio.create_task(consume("c"))
        while aengine.stats()["generation_tokens_total"] < 2:
            await asyncio.sleep(0.005)
        # a second request with the same id is refused and leaves the first alone
        with pytest.raises(InvalidRequestError) as info:
            async for _ in aengine.generate([9], greedy(), request_id="c"):
                pass
        assert info.value.param == "request_id"
        assert aengine.stats()["num_unfinished_requests"] == 1
        task.cancel()  # the consumer goes away: the request is aborted
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if aengine.stats()["num_unfinished_requests"] == 0:
                break
            await asyncio.sleep(0.01)
        return aengine.stats()

    try:
        stats = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert stats["num_unfinished_requests"] == 0 and stats["num_requests_aborted"] == 1
    assert stats["num_blocks_free"] == stats["num_blocks_total"]


def test_final_only_requests_report_nothing_until_finished():
    """LLM.generate reads only finished outputs; its requests skip building partial ones."""
    engine = make_engine()
    partial_id = engine.add_request("partial", [5, 6, 7], greedy(max_tokens=6))
    req = engine.prepare_request("final", [5, 6, 7], greedy(max_tokens=6))
    req.final_only = True
    engine.add_prepared(req)
    seen: dict[str, list] = {"partial": [], "final": []}
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen["partial"]) == 6 and partial_id == "partial"
    assert len(seen["final"]) == 1 and seen["final"][0].finished
    assert seen["final"][0].token_ids == seen["partial"][-1].token_ids == reference_output([5, 6, 7], 6)


def test_async_deltas_of_one_step_reach_a_loop_in_one_wakeup():
    """Every call_soon_threadsafe writes to the loop's self-pipe; 256 of them per step cost the
    engine thread ~4.8 ms. A step's deltas for one loop go in one call."""
    from loraplex.engine import async_engine

    engine = make_engine(num_blocks=200)
    aengine = AsyncLLMEngine(engine.config, engine=engine)
    batches: list[int] = []

    async def consume(i: int) -> list[int]:
        tokens = []
        async for delta in aengine.generate([5 + i, 6, 7], greedy(max_tokens=12), request_id=f"r{i}"):
            tokens += delta.outputs[0].token_ids
        return tokens

    async def main():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            if callback is async_engine._put_all:
                batches.append(len(args[0]))
            return real(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting
        return await asyncio.gather(*(consume(i) for i in range(16)))

    try:
        results = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert results == [reference_output([5 + i, 6, 7], 12) for i in range(16)]
    assert sum(batches) >= 16 * 12 // 2  # deltas (a delta may carry more than one token)...
    assert max(batches) > 1 and len(batches) <= sum(batches) // 4  # ...arrive many per wakeup
