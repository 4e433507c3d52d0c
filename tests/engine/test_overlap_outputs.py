"""``overlap_outputs``: a step's sampled tokens become outputs (detokenized, stop strings
checked) while the device runs the next step. Against the same engine without it, over the fake
paged runner: the same tokens, text, finish and stop reasons, streamed deltas and generation
count, each output one step later; stop strings found a step late still end the text where they
end; an abort sees every token sampled before it; nothing arrives after a request's final output
and no KV block or request is left behind. Then the real tiny model, with adapters, seeded
sampling and logprobs, and the async engine."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from types import SimpleNamespace

import pytest

from loraplex.config import EngineConfig
from loraplex.engine.async_engine import AsyncLLMEngine
from loraplex.engine.llm_engine import LLMEngine
from loraplex.sampling_params import SamplingParams
from tests.engine.scheduler_harness import FakeModelRunner, reference_output


def make_engine(overlap: bool, num_blocks: int = 64, **config) -> LLMEngine:
    runner = FakeModelRunner(num_blocks=num_blocks, block_size=4)
    return LLMEngine(EngineConfig(block_size=4, overlap_outputs=overlap, **config), runner=runner)


def _stop_from_reference(rng: random.Random, tokenizer, prompt: list[int], max_tokens: int) -> list[str]:
    """A stop string cut from the text the request will produce, so that it does end there
    (mid-token or across two tokens as it falls); none when that text gives nothing usable."""
    text = tokenizer.decode(reference_output(prompt, max_tokens), skip_special_tokens=True)
    if len(text) < 3:
        return []
    start = rng.randrange(len(text) - 2)
    stop = text[start : start + rng.choice([1, 2, 3])]
    return [] if "\ufffd" in stop or not stop.strip() else [stop]


def _workload(seed: int, tokenizer, with_stops: bool = True) -> dict[int, list[tuple]]:
    """step -> the requests (id, prompt, params, stream_deltas) added before it."""
    rng = random.Random(seed)
    arrivals: dict[int, list[tuple]] = defaultdict(list)
    for i in range(rng.randint(5, 12)):
        prompt = [rng.randrange(4, 97) for _ in range(rng.randint(1, 30))]
        max_tokens = rng.randint(1, 24)
        stop = _stop_from_reference(rng, tokenizer, prompt, max_tokens) if with_stops and rng.random() < 0.6 else []
        params = SamplingParams(
            temperature=0.0, ignore_eos=True, max_tokens=max_tokens, n=rng.choice([1, 1, 1, 2, 3]), stop=stop,
            include_stop_str_in_output=rng.random() < 0.3,
        )
        arrivals[rng.choice([0, 0, 0, 1, 2, 5, 9])].append((f"r{i}", prompt, params, rng.random() < 0.5))
    return arrivals


def _completions(out) -> list[tuple]:
    return [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs]


def _run(overlap: bool, seed: int, aborts: dict[int, list[str]] | None = None, with_stops: bool = True, **config):
    """Step a fresh engine through ``_workload(seed)``, aborting ``aborts[step]`` after that
    step; per request its final output (from a step or from ``abort``) and its streamed text."""
    engine = make_engine(overlap, **config)
    arrivals = _workload(seed, engine.tokenizer, with_stops)
    deltas = {rid: d for reqs in arrivals.values() for rid, _, _, d in reqs}
    finals: dict[str, list[tuple]] = {}
    streamed: dict[str, dict[int, tuple]] = defaultdict(dict)  # deltas summed: as _completions
    last_text: dict[tuple[str, int], str] = {}

    def take(out) -> None:
        rid = out.request_id
        assert rid not in finals, f"{rid}: an output after its final one"
        for index, tokens, text, reason, stop_reason in _completions(out):
            if deltas[rid]:  # a completion's finish is reported once, in the delta that ends it
                _, sent_tokens, sent_text, sent_reason, _ = streamed[rid].get(index, (index, [], "", None, None))
                assert sent_reason is None
                streamed[rid][index] = (index, sent_tokens + tokens, sent_text + text, reason, stop_reason)
            else:  # cumulative outputs only grow
                assert text.startswith(last_text.get((rid, index), ""))
                last_text[rid, index] = text
        if out.finished:
            finals[rid] = sorted(streamed[rid].values()) if deltas[rid] else _completions(out)

    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for rid, prompt, params, stream_deltas in arrivals.get(step, []):
            engine.add_request(rid, prompt, params, stream_deltas=stream_deltas)
        for out in engine.step():
            take(out)
        for rid in (aborts or {}).get(step, []):
            out = engine.abort(rid)
            if out is not None:
                take(out)
        step += 1
        assert step < 1000
    stats = engine.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0
    assert engine.step() == [] and engine.last_step_was_empty
    assert set(finals) == set(deltas)
    return finals, dict(streamed), stats


CONFIGS = [
    {},  # plenty of room: one batch
    {"max_num_batched_tokens": 16},  # chunked prefills
    {"max_num_batched_tokens": 16, "num_blocks": 14},  # and preemption
]


@pytest.mark.parametrize("config", CONFIGS, ids=["roomy", "chunked", "preempting"])
@pytest.mark.parametrize("seed", range(12))
def test_outputs_match_the_engine_without_overlap(seed, config):
    sync_finals, sync_streamed, sync_stats = _run(False, seed, **config)
    finals, streamed, stats = _run(True, seed, **config)
    assert finals == sync_finals
    assert streamed == sync_streamed
    assert stats["generation_tokens_total"] == sync_stats["generation_tokens_total"]
    assert stats["num_chunked_prefills"] > 0 or "max_num_batched_tokens" not in config
    assert stats["num_preemptions"] > 0 or "num_blocks" not in config
    # each final text against the fake model's reference: the comparison above is not vacuous
    engine = make_engine(False)
    arrivals = _workload(seed, engine.tokenizer)
    for rid, prompt, params, _ in (r for reqs in arrivals.values() for r in reqs):
        for index, token_ids, text, reason, stop_reason in finals[rid]:
            ref = reference_output(prompt, params.max_tokens)
            assert token_ids == ref[: len(token_ids)]
            if reason == "length":
                assert len(token_ids) == params.max_tokens and stop_reason is None
            else:
                assert reason == "stop" and stop_reason == params.stop[0]
                full = engine.tokenizer.decode(ref, skip_special_tokens=True)
                end = full.find(stop_reason)
                assert text == full[: end + len(stop_reason) if params.include_stop_str_in_output else end]


@pytest.mark.parametrize("seed", range(8))
def test_aborts_see_every_token_sampled_before_them(seed):
    """Without stop strings both engines schedule alike, so an abort after step k ends a
    request with the same tokens either way: the overlapped engine detokenizes the last step's
    tokens for it; a request that had already finished gets its final output from ``abort``."""
    rng = random.Random(1000 + seed)
    engine = make_engine(False)
    ids = [rid for reqs in _workload(seed, engine.tokenizer, with_stops=False).values() for rid, *_ in reqs]
    aborts: dict[int, list[str]] = defaultdict(list)
    for rid in rng.sample(ids, k=len(ids) // 2):
        aborts[rng.randrange(12)].append(rid)
    config = {"max_num_batched_tokens": 16, "num_blocks": 20}
    sync = _run(False, seed, aborts, with_stops=False, **config)
    over = _run(True, seed, aborts, with_stops=False, **config)
    assert over[0] == sync[0] and over[1] == sync[1]
    reasons = [c[3] for completions in sync[0].values() for c in completions]
    assert "abort" in reasons and "length" in reasons


def _stop_case(engine):
    for seed in range(200):
        rng = random.Random(seed)
        prompt = [rng.randrange(4, 97) for _ in range(5)]
        text = engine.tokenizer.decode(reference_output(prompt, 30), skip_special_tokens=True)
        if len(text) >= 12 and "\ufffd" not in text[:10] and text.find(text[6:8]) == 6:
            return prompt, text[6:8]
    pytest.fail("no stop-string case found")


def _stream(engine, steps: int | None = None) -> tuple[str, list[int], list]:
    """Step ``engine`` (``steps`` times, else until its one request finishes); the request's
    streamed text and tokens, and its final outputs."""
    text, tokens, finals, done = "", [], [], 0
    while (done < steps) if steps is not None else not finals:
        for out in engine.step():
            text, tokens = text + out.outputs[0].text, tokens + out.outputs[0].token_ids
            finals += [out] if out.finished else []
        done += 1
    return text, tokens, finals


def test_abort_after_the_step_that_completed_a_stop_string_reports_the_stop():
    sync = make_engine(False)
    prompt, stop = _stop_case(sync)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=30, stop=[stop])
    sync.add_request("s", prompt, params, stream_deltas=True)
    sync_text, sync_tokens, [expected] = _stream(sync)
    steps = sync.scheduler.stats.num_steps
    assert expected.outputs[0].finish_reason == "stop"

    over = make_engine(True)
    over.add_request("s", prompt, params, stream_deltas=True)
    text, tokens, finals = _stream(over, steps)  # the stop's token is sampled, its text not yet read
    assert finals == [] and over.has_unfinished()
    final = over.abort("s")
    assert final.finished and _completions(final)[0][3:] == ("stop", stop)
    assert text + final.outputs[0].text == sync_text and tokens + final.outputs[0].token_ids == sync_tokens
    assert over.num_requests_aborted == 0 and over.num_requests_finished == 1
    assert over.step() == [] and not over.has_unfinished()
    assert over.stats()["num_blocks_free"] == over.stats()["num_blocks_total"]


def test_a_step_with_nothing_to_run_delivers_what_waits():
    engine = make_engine(True)
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2))
    assert engine.step() == []  # the prefill's token waits for the next step
    [first] = engine.step()  # while the last token is sampled
    assert first.outputs[0].token_ids == reference_output([5, 6, 7], 2)[:1] and not first.finished
    assert engine.has_unfinished()  # its final output has not left yet
    [final] = engine.step()  # nothing scheduled: the flush
    assert final.finished and final.outputs[0].token_ids == reference_output([5, 6, 7], 2)
    assert not engine.last_step_was_empty and not engine.has_unfinished()
    assert engine.step() == [] and engine.last_step_was_empty


def _outputs_by_step(engine: LLMEngine, events: list[str] | None = None) -> list[list[tuple]]:
    """Step until done; per step what reached the caller, through ``deliver`` (then marked, and
    logged in ``events`` with each read-back of the step's tokens) or returned."""
    launch = engine.runner.launch

    def logged_launch(sched_out):
        run = launch(sched_out)
        return SimpleNamespace(result=lambda: (events.append("read back"), run.result())[1])

    if events is not None:
        engine.runner.launch = logged_launch
    steps = []
    while engine.has_unfinished():
        delivered = []

        def deliver(outputs):
            events.append("deliver")
            delivered.extend(("early", out.request_id, out.finished, _completions(out)) for out in outputs)

        returned = engine.step(deliver if events is not None else None)
        steps.append(delivered + [("returned", o.request_id, o.finished, _completions(o)) for o in returned])
    return steps


def test_deliver_takes_the_last_steps_outputs_before_this_steps_tokens_are_read_back():
    prompts = {f"d{i}": [5 + i, 9, 30 + i] for i in range(4)}
    runs = []
    for events in (None, []):
        engine = make_engine(True)
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=3 + int(rid[1])),
                               stream_deltas=True)
        runs.append((_outputs_by_step(engine, events), events))
    (plain, _), (early, events) = runs
    # the same outputs in the same steps; with deliver, all of them before the step's read-back
    # but those of a step that ran nothing (the flush after the last one)
    assert [[o[1:] for o in step] for step in early] == [[o[1:] for o in step] for step in plain]
    assert all(o[0] == "early" for step in early[:-1] for o in step) and early[-1][0][0] == "returned"
    assert early[0] == [] and events[0] == "read back"  # the first step had nothing to deliver yet
    assert events.count("deliver") == len(early) - 2 and all(
        events[i + 1] == "read back" for i, e in enumerate(events) if e == "deliver")
    assert sum(o[2] for step in early for o in step) == len(prompts)


def test_default_is_off_on_cpu_and_the_option_turns_it_on(caplog):
    with caplog.at_level("INFO", logger="loraplex.engine"):
        assert make_engine(None).overlap_outputs is False
        assert make_engine(True).overlap_outputs is True
    # the start-up line says which
    starts = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loraplex engine:")]
    assert ["overlap_outputs=off " in s for s in starts] == [True, False]
    assert "cuda_graphs=off overlap_outputs=on overlap_lora_shrink=off" in starts[1]


def test_async_streams_with_overlap():
    engine = make_engine(True, num_blocks=256, max_model_len=512)
    aengine = AsyncLLMEngine(engine.config, engine=engine)
    prompts = {f"a{i}": [4 + i, 20 + i, 40 + i] for i in range(6)}

    async def consume(rid, prompt):
        tokens, finals = [], 0
        async for delta in aengine.generate(prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=15),
                                            request_id=rid):
            tokens += delta.outputs[0].token_ids
            finals += delta.finished
        return tokens, finals

    async def main():  # a final output that never left would hang here
        return await asyncio.wait_for(asyncio.gather(*(consume(rid, p) for rid, p in prompts.items())), 60)

    try:
        results = asyncio.run(main())
    finally:
        aengine.shutdown()
    for (tokens, finals), prompt in zip(results, prompts.values()):
        assert tokens == reference_output(prompt, 15) and finals == 1


@pytest.mark.slow
def test_real_model_with_adapters_sampling_and_logprobs(tiny_llama_dir, tmp_path):
    """The tiny llama through ``LLM``: greedy and seeded random sampling, logprobs, n=2, two
    adapters and the base in one run, chunked and preempting; overlap changes nothing."""
    import torch
    from transformers import AutoModelForCausalLM

    from loraplex.engine.llm import LLM
    from tests.engine.test_engine_exact import tight_llm
    from tests.fixtures.peft_adapters import make_peft_adapter

    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    adapters = {name: make_peft_adapter(base, tmp_path / name, seed=seed) for name, seed in (("a", 1), ("b", 2))}
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 250) for _ in range(rng.randint(2, 60))] for _ in range(12)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True, n=2),
        SamplingParams(temperature=1.0, seed=3, max_tokens=9, logprobs=1),
    ]
    which = [[None, "a", "b"][i % 3] for i in range(len(prompts))]
    runs = []
    for overlap in (False, True):
        llm: LLM = tight_llm(tiny_llama_dir, tmp_path / f"home-{overlap}", num_blocks=24, max_loras=2,
                             overlap_outputs=overlap)
        for name, path in adapters.items():
            llm.add_adapter(name, str(path))
        outs = llm.generate(prompts, [params[i % 3] for i in range(len(prompts))], adapters=which)
        runs.append([[(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in o.outputs]
                     for o in outs])
        stats = llm.engine.stats()
        assert stats["num_blocks_free"] == stats["num_blocks_total"]
        if overlap:
            assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0
    assert runs[0] == runs[1]


@pytest.mark.slow
def test_the_overlap_benchmark_runs_and_finds_the_same_tokens():
    """benchmarks/bench_overlap.py at a small size: it exits non-zero if overlap_outputs or
    schedule_ahead changed a token."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_overlap.py"), "--batch", "8", "--adapters",
                          "2", "--max-tokens", "8", "--rounds", "1", "--device-ms", "0", "2"],
                         capture_output=True, text=True, timeout=600, cwd=root)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| 0.0 |") or line.startswith("| 2.0 |")]
    assert len(rows) == 2 and all(float(cell) > 0 for row in rows for cell in row.strip("| ").split(" | ")[1:])
    assert "| device ms per step | both off | overlap_outputs | + schedule_ahead |" in run.stdout
    (ahead,) = [line for line in run.stdout.splitlines() if line.startswith("steps launched ahead")]
    assert int(ahead.rsplit(" ", 1)[1]) > 0
