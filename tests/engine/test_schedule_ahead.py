"""``schedule_ahead``: the next plain decode step is scheduled and launched before this one's
tokens are read back (loraplex/engine/schedule_ahead.py).

Against the same engine without it, over the fake paged runner (which runs a step launched
ahead once the step before is applied, with its KV checked against the block tables): the same
tokens, text, finish and stop reasons, streamed deltas and generation count, with and without
overlap_outputs, roomy, chunked and preempting, with aborts; no block or request left behind.
The scheduler's step ahead leaves the state a ``schedule()`` after the update leaves. Steps do
not go ahead when something waits, or when blocks are short. Then the real tiny model with adapters and logprobs,
eagerly here and through the CUDA-graph path in tests/kernels/test_schedule_ahead_graphs.py.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from collections import defaultdict

import pytest

from loraplex.sampling_params import SamplingParams
from tests.engine.scheduler_harness import FakeModelRunner, Harness, reference_output
from tests.engine.test_overlap_outputs import CONFIGS, _run, _workload, make_engine


@pytest.mark.parametrize("overlap", [False, True], ids=["sync-outputs", "overlap-outputs"])
@pytest.mark.parametrize("config", CONFIGS, ids=["roomy", "chunked", "preempting"])
@pytest.mark.parametrize("seed", range(8))
def test_outputs_match_the_engine_that_waits(seed, config, overlap, monkeypatch):
    sync_finals, sync_streamed, sync_stats = _run(False, seed, **config)
    launches = []
    launch = FakeModelRunner.launch

    def counting_launch(self, out, after=None):
        launches.append(after is not None)
        return launch(self, out, after)

    monkeypatch.setattr(FakeModelRunner, "launch", counting_launch)
    finals, streamed, stats = _run(overlap, seed, schedule_ahead=True, **config)
    assert finals == sync_finals
    assert streamed == sync_streamed
    assert stats["generation_tokens_total"] == sync_stats["generation_tokens_total"]
    assert sum(launches) > 0, "no step went ahead: the comparison would be vacuous"


@pytest.mark.parametrize("seed", range(6))
def test_aborts_between_steps_end_requests_as_without_it(seed):
    """A step launched ahead holds no new request: one that arrives meanwhile is admitted a step
    later, so an abort after step k may find fewer tokens than the engine that waits. What holds:
    requests nobody aborts end alike, an aborted one holds a prefix of its full output, and no
    block or request is left (``_run``)."""
    rng = random.Random(2000 + seed)
    engine = make_engine(False)
    arrivals = _workload(seed, engine.tokenizer, with_stops=False)
    requests = {rid: (prompt, params) for reqs in arrivals.values() for rid, prompt, params, _ in reqs}
    aborts: dict[int, list[str]] = defaultdict(list)
    aborted = rng.sample(sorted(requests), k=len(requests) // 2)
    for rid in aborted:
        aborts[rng.randrange(12)].append(rid)
    sync = _run(False, seed, aborts, with_stops=False)[0]
    ahead = _run(False, seed, aborts, with_stops=False, schedule_ahead=True)[0]
    assert {r: c for r, c in ahead.items() if r not in aborted} == {r: c for r, c in sync.items() if r not in aborted}
    for rid in aborted:
        prompt, params = requests[rid]
        full = reference_output(prompt, params.max_tokens)
        for index, tokens, text, reason, stop_reason in ahead[rid]:
            assert tokens == full[: len(tokens)] and reason in ("abort", "length")
    reasons = [c[3] for rid in aborted for c in ahead[rid]]
    assert "abort" in reasons


def _decoding_pair(**params):
    """Two harnesses in the same state: three sequences past their prompts, decoding."""
    pair = []
    for _ in range(2):
        h = Harness(num_blocks=32, block_size=4)
        for prompt in ([5, 6, 7], [8, 9, 10, 11, 12], [13, 14]):
            h.add(prompt, max_tokens=20, **params)
        h.step()  # the prompts
        pair.append(h)
    return pair


def test_the_step_ahead_is_the_step_schedule_would_make_after_the_update():
    ahead_h, sync_h = _decoding_pair()
    for i in range(6):  # across block boundaries (block size 4)
        prev = ahead_h.scheduler.schedule()
        run_out = ahead_h.runner.execute(prev)
        if i in (2, 4):  # a request arrives while prev runs: both admit it into the next step
            ahead_h.add([60 + i, 61, 62])
        ahead = ahead_h.scheduler.schedule_ahead(prev)  # before prev's tokens are applied
        ahead_h.scheduler.update(prev, run_out)
        sync_h.step()
        if i in (2, 4):
            sync_h.add([60 + i, 61, 62])
        want = sync_h.scheduler.schedule()  # after
        assert [(e.seq.seq_id, e.start_pos, e.num_tokens, e.needs_sample) for e in ahead.scheduled] == [
            (e.seq.seq_id, e.start_pos, e.num_tokens, e.needs_sample) for e in want.scheduled]
        assert [s.block_tables for s in ahead_h.seqs] == [s.block_tables for s in sync_h.seqs]
        assert [s.num_computed_tokens for s in ahead_h.seqs] == [s.num_computed_tokens for s in sync_h.seqs]
        assert ahead_h.block_manager.num_free_blocks == sync_h.block_manager.num_free_blocks
        assert ahead_h.scheduler.stats.num_steps == sync_h.scheduler.stats.num_steps
        # the fake runner checks each step's KV slots and context against its tables
        ahead_h.scheduler.update(ahead, ahead_h.runner.execute(ahead))
        sync_h.scheduler.update(want, sync_h.runner.execute(want))
        assert [s.output_token_ids for s in ahead_h.seqs] == [s.output_token_ids for s in sync_h.seqs]


@pytest.mark.parametrize("params", [
    dict(repetition_penalty=1.2), dict(frequency_penalty=0.5), dict(presence_penalty=0.5),
    dict(min_tokens=10), dict(seed=7), dict(bad_words_token_ids=[[5], [6, 7]]), dict(grammar=True),
], ids=["repetition", "frequency", "presence", "min_tokens", "seeded", "bad_words", "grammar"])
def test_every_sampling_option_goes_ahead(params):
    """Penalties, min_tokens, seeds and bad words read the token the step before is still
    drawing on the device (the sampler's ``pending``; checked against the full history in
    tests/engine/test_penalties.py and tests/engine/test_bad_words.py); a grammar's draw waits
    until that token is applied (``DeferredDraw``; end to end on the tiny model below)."""
    grammar = params.pop("grammar", False)
    h, _ = _decoding_pair(**params)
    for seq in h.seqs:
        seq.params.temperature = 0.8
        if grammar:
            seq.grammar = SimpleNamespace()  # a matcher: its state follows the tokens, on the host
    prev = h.scheduler.schedule()
    assert h.scheduler.schedule_ahead(prev) is not None


def test_waiting_requests_join_the_step_ahead_and_one_left_waiting_gets_a_schedule_next():
    h, _ = _decoding_pair()
    first = h.add([40, 41])
    prev = h.scheduler.schedule()  # the three decodes and the new prompt, whole: it samples too
    run_out = h.runner.execute(prev)
    ahead = h.scheduler.schedule_ahead(prev)
    assert [(e.seq.seq_id, e.start_pos, e.num_tokens) for e in ahead.scheduled] == [
        (e.seq.seq_id, e.start_pos + e.num_tokens, 1) for e in prev.scheduled]
    assert ahead.scheduled[-1].seq is first and ahead.scheduled[-1].start_pos == 2
    h.scheduler.update(prev, run_out)
    h.scheduler.update(ahead, h.runner.execute(ahead))

    prev = h.scheduler.schedule()  # four decodes; then a request arrives while they run
    run_out = h.runner.execute(prev)
    new = h.add([42, 43, 44])
    ahead = h.scheduler.schedule_ahead(prev)
    assert [(e.seq.seq_id, e.start_pos, e.num_tokens) for e in ahead.scheduled] == [
        (e.seq.seq_id, e.start_pos + 1, 1) for e in prev.scheduled] + [(new.seq_id, 0, 3)]
    h.scheduler.update(prev, run_out)
    h.scheduler.update(ahead, h.runner.execute(ahead))
    assert new.output_token_ids and h.scheduler.num_waiting == 0

    full = Harness(num_blocks=32, block_size=4, max_num_seqs=2)
    for prompt in ([5, 6, 7], [8, 9, 10], [11, 12]):
        full.add(prompt, max_tokens=20)
    full.step()
    prev = full.scheduler.schedule()  # two decodes; the third request waits for a seat
    run_out = full.runner.execute(prev)
    ahead = full.scheduler.schedule_ahead(prev)  # the same two: still no seat
    assert len(ahead.scheduled) == 2 and full.scheduler.num_waiting == 1
    full.scheduler.update(prev, run_out)
    assert full.scheduler.schedule_ahead(ahead) is None  # it left one waiting: schedule() comes next
    full.scheduler.update(ahead, full.runner.execute(ahead))


def _key(out):
    return [(e.seq.seq_id, e.start_pos, e.num_tokens, e.needs_sample) for e in out.scheduled]


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_prompt_chunks_continue_in_the_step_ahead_as_schedule_would_cut_them(prefix_caching):
    """Long prompts cut into chunks of an 8-token budget beside decodes, with arrivals while a
    step runs: every step goes ahead, and each is the step ``schedule()`` makes after the update
    (entries in its order, tables, computed counts, free blocks), one step after another."""
    pair = []
    for _ in range(2):
        h = Harness(num_blocks=64, block_size=4, max_num_batched_tokens=8, enable_prefix_caching=prefix_caching)
        for prompt in ([5, 6, 7], [8, 9]):
            h.add(prompt, max_tokens=30)
        h.step()
        pair.append(h)
    ahead_h, sync_h = pair
    arrivals = {0: list(range(20, 41)), 3: list(range(20, 33)), 5: list(range(70, 81))}
    prev, sync_prev = ahead_h.scheduler.schedule(), sync_h.scheduler.schedule()
    chunked = 0
    for i in range(14):
        run_out = ahead_h.runner.execute(prev)
        if i in arrivals:  # a request arrives while prev runs: both admit it into the next step
            ahead_h.add(arrivals[i], max_tokens=20)
        ahead = ahead_h.scheduler.schedule_ahead(prev)  # before prev's tokens are applied
        assert ahead is not None, f"step {i} did not go ahead"
        ahead_h.scheduler.update(prev, run_out)

        sync_run_out = sync_h.runner.execute(sync_prev)
        if i in arrivals:
            sync_h.add(arrivals[i], max_tokens=20)
        sync_h.scheduler.update(sync_prev, sync_run_out)
        want = sync_h.scheduler.schedule()  # after
        assert _key(ahead) == _key(want), i
        assert [s.block_tables for s in ahead_h.seqs] == [s.block_tables for s in sync_h.seqs]
        assert [s.num_computed_tokens for s in ahead_h.seqs] == [s.num_computed_tokens for s in sync_h.seqs]
        assert ahead_h.block_manager.num_free_blocks == sync_h.block_manager.num_free_blocks
        assert ahead_h.scheduler.stats.num_steps == sync_h.scheduler.stats.num_steps
        assert [s.output_token_ids for s in ahead_h.seqs] == [s.output_token_ids for s in sync_h.seqs]
        chunked += ahead.num_chunked_prefills
        prev, sync_prev = ahead, want
    assert chunked >= 3, "no prompt chunk went ahead: the comparison would be vacuous"
def test_a_request_the_token_budget_holds_back_does_not_stop_the_next_step_going_ahead():
    """The budget a step ahead has is the budget ``schedule()`` after the update would have
    (the same decodes and chunks): a request it leaves waiting for tokens would wait there too,
    so steps keep going ahead while a prompt's chunks take the budget."""
    h, _ = _decoding_pair()
    h.scheduler.config.max_num_batched_tokens = 8
    long = h.add(list(range(20, 45)), max_tokens=4)
    queued = h.add([50, 51, 52, 53, 54], max_tokens=4)
    queued_too = h.add([60, 61, 62, 63, 64, 65], max_tokens=4)
    prev = h.scheduler.schedule()  # three decodes and 5 of the long prompt; the short ones wait
    assert [e.num_tokens for e in prev.scheduled] == [1, 1, 1, 5] and h.scheduler.num_waiting == 2
    for chunk in (5, 5, 5, 5):  # the long prompt's next chunks (25 tokens), each beside the three decodes
        run_out = h.runner.execute(prev)
        ahead = h.scheduler.schedule_ahead(prev)
        assert ahead is not None and h.scheduler.num_waiting == 2
        assert [(e.seq, e.num_tokens) for e in ahead.scheduled][-1] == (long, chunk)
        h.scheduler.update(prev, run_out)
        prev = ahead
    # the last chunk ended the prompt: a decode now, and the first short prompt gets the budget
    # left, part of it; the other waits for tokens, as it would in schedule()
    run_out = h.runner.execute(prev)
    ahead = h.scheduler.schedule_ahead(prev)
    assert [(e.seq, e.num_tokens) for e in ahead.scheduled][-2:] == [(long, 1), (queued, 4)]
    assert h.scheduler.num_waiting == 1
    h.scheduler.update(prev, run_out)
    prev = ahead
    run_out = h.runner.execute(prev)
    ahead = h.scheduler.schedule_ahead(prev)
    assert [(e.seq, e.num_tokens, e.needs_sample) for e in ahead.scheduled][-3:] == [
        (long, 1, True), (queued, 1, True), (queued_too, 3, False)]
    h.scheduler.update(prev, run_out)
    h.scheduler.update(ahead, h.runner.execute(ahead))
    assert len(long.output_token_ids) == 3 and len(queued.output_token_ids) == 1


def test_a_sequence_that_ended_after_the_step_was_built_is_left_out_of_the_next():
    """A sequence that ends in N-1's update still computes a (dropped) row in N, built ahead;
    the step after N goes ahead without it, as ``schedule()`` would leave it out."""
    h, _ = _decoding_pair()
    short = h.seqs[0]
    short.params.max_tokens = 3  # one token from its prompt's step, two more decodes
    prev = h.scheduler.schedule()
    run_out = h.runner.execute(prev)
    steps = []
    for _ in range(4):
        ahead = h.scheduler.schedule_ahead(prev)
        assert ahead is not None
        h.scheduler.update(prev, run_out)
        steps.append([e.seq for e in ahead.scheduled])
        prev, run_out = ahead, h.runner.execute(ahead)
    h.scheduler.update(prev, run_out)
    # built before the update that ended it: its dropped row; the steps after are without it
    assert [short in seqs for seqs in steps] == [True, True, False, False]
    assert len(short.output_token_ids) == 3 and short.is_finished
    assert [len(s.output_token_ids) for s in h.seqs[1:]] == [6, 6]


def test_no_step_goes_ahead_from_a_chunk_that_reports_prompt_logprobs():
    """Which prompt positions a chunk reports depends on the logprobs the update of the step
    before appends: such a chunk waits for it."""
    h = Harness(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    h.add(list(range(5, 25)), max_tokens=4, prompt_logprobs=1)
    prev = h.scheduler.schedule()
    assert not prev.scheduled[0].needs_sample and h.scheduler.schedule_ahead(prev) is None
    plain = Harness(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    plain.add(list(range(5, 25)), max_tokens=4)
    prev = plain.scheduler.schedule()
    assert [(e.start_pos, e.num_tokens) for e in plain.scheduler.schedule_ahead(prev).scheduled] == [(8, 8)]


@pytest.mark.parametrize("seed", range(6))
def test_steps_ahead_under_random_chunked_load_are_the_steps_schedule_makes(seed):
    counts = _lockstep_under_random_load(seed)
    assert counts["ahead"] > 20 and counts["chunks ahead"] > 0, counts


def test_the_random_chunked_load_reaches_every_case_it_claims():
    totals = defaultdict(int)
    for seed in range(6):
        for key, value in _lockstep_under_random_load(seed).items():
            totals[key] += value
    assert all(totals[k] > 0 for k in ("ahead", "fell back", "chunks ahead", "ahead with some waiting")), totals


def _lockstep_under_random_load(seed: int) -> dict[str, int]:
    """Random arrivals of prompts up to four budgets long, a short token budget, few seats:
    in lockstep with a twin that waits, every step (ahead where it may, else ``schedule()``
    after the update, as the engine does) holds the entries the twin's ``schedule()`` makes for
    the sequences still running (one that the step before ended computes a dropped row ahead).
    Chunks continue ahead, and requests held back only by the budget do not stop the next step
    going ahead."""
    rng = random.Random(500 + seed)
    config = dict(num_blocks=96, block_size=4, max_num_batched_tokens=6, max_num_seqs=8)
    ahead_h, sync_h = Harness(**config), Harness(**config)
    # none ends within the 60 steps: a sequence the step before ended still takes a (dropped)
    # token of the budget ahead, so what follows it may be cut differently (same outputs:
    # test_outputs_match_the_engine_that_waits)
    arrivals = {i: [[rng.randrange(5, 90) for _ in range(rng.randint(1, 32))], 70]
                for i in sorted(rng.sample(range(40), 14))}
    counts = defaultdict(int)
    prev = sync_prev = None
    for i in range(60):
        for h in (ahead_h, sync_h):
            if i in arrivals:  # arrives while the step before runs
                h.add(arrivals[i][0], max_tokens=arrivals[i][1])
        if prev is None:
            prev, sync_prev = ahead_h.scheduler.schedule(), sync_h.scheduler.schedule()
            continue
        run_out = ahead_h.runner.execute(prev)
        ahead = ahead_h.scheduler.schedule_ahead(prev)  # before prev's tokens are applied
        ahead_h.scheduler.update(prev, run_out)
        if ahead is None:
            counts["fell back"] += 1
            ahead = ahead_h.scheduler.schedule()
        else:
            counts["ahead"] += 1
            counts["chunks ahead"] += ahead.num_chunked_prefills
            counts["ahead with some waiting"] += bool(ahead_h.scheduler.waiting)
        sync_h.scheduler.update(sync_prev, sync_h.runner.execute(sync_prev))
        want = sync_h.scheduler.schedule()
        assert _key(ahead) == _key(want), i
        assert [(s.block_tables, s.num_computed_tokens, s.output_token_ids, s.status) for s in ahead_h.seqs] == [
            (s.block_tables, s.num_computed_tokens, s.output_token_ids, s.status) for s in sync_h.seqs]
        assert ahead_h.block_manager.num_free_blocks == sync_h.block_manager.num_free_blocks
        counts["preempted"] += want.num_preempted
        prev, sync_prev = ahead, want
    return counts


def test_no_step_goes_ahead_when_blocks_are_short():
    short = Harness(num_blocks=4, block_size=4)  # 16 slots
    for prompt in ([5, 6, 7], [8, 9, 10]):
        short.add(prompt, max_tokens=20)
    short.step()
    for _ in range(5):
        prev = short.scheduler.schedule()
        run_out = short.runner.execute(prev)
        free = short.block_manager.num_free_blocks
        computed = [s.num_computed_tokens for s in short.seqs]
        ahead = short.scheduler.schedule_ahead(prev)
        if ahead is None:  # one of them needs a block and none is free: nothing was changed
            assert short.block_manager.num_free_blocks == free == 0
            assert [s.num_computed_tokens for s in short.seqs] == computed
            return
        short.scheduler.update(prev, run_out)
        short.scheduler.update(ahead, short.runner.execute(ahead))
    pytest.fail("the blocks never ran short")


@pytest.mark.slow
@pytest.mark.parametrize("chunked,options", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["whole-prompts", "prompt-chunks", "whole-prompts-options", "prompt-chunks-options"])
def test_real_tiny_model_with_adapters_gives_the_same_outputs(tiny_llama_dir, tmp_path, chunked, options, monkeypatch):
    """``prompt-chunks``: prompts longer than an 8-token budget, so their chunks go ahead beside
    decodes whose input tokens are still being sampled. ``options``: penalties, ``min_tokens``,
    seeded draws and bad words (two greedy rows ban every token right after itself: each
    word's prefix is the token the step before is still drawing), which read that token on the
    device."""
    from transformers import AutoModelForCausalLM

    from loraplex.engine import sampler as sampler_module
    from loraplex.engine.llm import LLM
    from tests.fixtures.peft_adapters import make_peft_adapter
    from tests.fixtures.tiny_models import VOCAB_SIZE

    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype="float32").eval()
    adapters = {n: make_peft_adapter(base, tmp_path / n, seed=i, r=4 * (i + 1), target_modules="all-linear")
                for i, n in enumerate(("a", "b"))}
    rng = random.Random(3)
    lengths = (10, 30) if chunked else (2, 9)
    prompts = [[rng.randrange(4, 250) for _ in range(rng.randrange(*lengths))] for _ in range(6)]
    budget = dict(max_num_batched_tokens=8) if chunked else {}
    which = ["a", None, "b", "a", None, "b"]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(3, 12), logprobs=2, n=1 + (i == 3))
              for i in range(6)]
    if options:  # greedy under penalties; seeded draws (the shared generator's would follow the batches)
        steer = [dict(repetition_penalty=1.5), dict(frequency_penalty=1.5, presence_penalty=0.5),
                 dict(temperature=0.9, seed=11, min_tokens=8), dict(temperature=1.2, seed=5, presence_penalty=1.0),
                 dict(presence_penalty=2.0), dict(temperature=0.7, seed=2, repetition_penalty=1.3)]
        params = [SamplingParams(max_tokens=12, logprobs=2, n=1 + (i == 3), **{"temperature": 0.0, **extra})
                  for i, extra in enumerate(steer)]
        # and two greedy rows of prompts that repeat tokens greedily, banned from doing so
        no_repeats = [[t, t] for t in range(VOCAB_SIZE)]
        prompts, which = prompts + [prompts[1], prompts[4]], which + [None, None]
        params += [SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, bad_words_token_ids=no_repeats)
                   for _ in range(2)]
    ahead_bans = []  # steps that banned bad words of rows whose last token was still being drawn
    apply_bad_words = sampler_module.apply_bad_words

    def spy(logits, seqs, pending=None):
        if pending is not None and any(seqs[row].params.bad_words_token_ids for row in pending.rows):
            ahead_bans.append(len(pending.rows))
        return apply_bad_words(logits, seqs, pending)

    monkeypatch.setattr(sampler_module, "apply_bad_words", spy)
    results = []
    for ahead in (False, True):
        llm = LLM(model=str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_bytes=4 << 20, max_loras=4,
                  max_lora_rank=8, max_num_seqs=8, max_model_len=64, schedule_ahead=ahead, **budget)
        for name, path in adapters.items():
            llm.add_adapter(name, str(path))
        launch, afters = llm.engine.runner.launch, []
        llm.engine.runner.launch = lambda out, after=None: (
            afters.append((after is not None, out.num_chunked_prefills)), launch(out, after))[1]
        outs = llm.generate(prompts, params, adapters=which)
        results.append([[(c.token_ids, c.logprobs, c.finish_reason) for c in o.outputs] for o in outs])
        assert any(a for a, _ in afters) == ahead
        if ahead and chunked:
            assert any(a and chunks for a, chunks in afters), "no prompt chunk went ahead"
        engine = llm.engine
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        engine.step()  # nothing left to run: hands the runner the sequences the last step ended
        assert len(engine.runner.sampler.prompts) == 0  # each penalized prompt released with its sequence
    sync, ahead = results
    if options:
        assert ahead_bans, "no bad word was matched against a token still on the device"
        for tokens in (ahead[6][0][0], ahead[7][0][0]):
            assert all(a != b for a, b in zip(tokens, tokens[1:])), tokens
    for want, got in zip(sync, ahead):
        for (w_tokens, w_lps, w_reason), (g_tokens, g_lps, g_reason) in zip(want, got):
            assert g_tokens == w_tokens and g_reason == w_reason
            assert len(w_lps) == len(g_lps) == len(w_tokens)
            for w, g in zip(w_lps, g_lps):  # the batches differ in dropped rows: fp32 GEMMs of other sizes
                assert w["token_id"] == g["token_id"] and abs(w["logprob"] - g["logprob"]) < 1e-4
                assert w["top_logprobs"].keys() == g["top_logprobs"].keys()
                assert all(abs(w["top_logprobs"][t] - g["top_logprobs"][t]) < 1e-4 for t in w["top_logprobs"])


def test_tokens_after_follows_the_sequences_not_the_rows():
    import torch

    from loraplex.engine.pending_run import tokens_after

    seqs = [SimpleNamespace(seq_id=i) for i in (7, 3, 9)]
    after = SimpleNamespace(tokens=SimpleNamespace(token_ids=torch.tensor([70, 30, 90])), seqs=seqs)
    same = [SimpleNamespace(seq=s) for s in seqs]
    assert tokens_after(same, after) is after.tokens.token_ids  # a steady batch: the tensor as it is
    other = [SimpleNamespace(seq=seqs[i]) for i in (2, 0, 1)]
    assert tokens_after(other, after).tolist() == [90, 70, 30]
    assert tokens_after(other[:2], after).tolist() == [90, 70]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync-outputs", "overlap-outputs"])
def test_async_engine_streams_with_steps_ahead_and_aborts(overlap):
    """The async engine (its own thread stepping, deliver callbacks, aborts from the event loop)
    over the fake runner: streamed tokens are the reference's, a client that gives up midway is
    aborted, every stream ends once, and nothing is held after."""
    import asyncio

    from loraplex.engine.async_engine import AsyncLLMEngine

    engine = make_engine(overlap, num_blocks=256, max_model_len=512, schedule_ahead=True)
    launches = []
    launch = engine.runner.launch
    engine.runner.launch = lambda out, after=None: (launches.append(after is not None), launch(out, after))[1]
    aengine = AsyncLLMEngine(engine.config, engine=engine)
    prompts = {f"a{i}": [4 + i, 20 + i, 40 + i] for i in range(8)}

    async def consume(rid, prompt, give_up_after=None):
        tokens, finals = [], 0
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=15)
        async for delta in aengine.generate(prompt, params, request_id=rid):
            tokens += delta.outputs[0].token_ids
            finals += delta.finished
            if give_up_after is not None and len(tokens) >= give_up_after:
                break  # the client leaves: the engine aborts the request
        return tokens, finals

    async def main():
        jobs = [consume(rid, p, 4 if i % 3 == 0 else None) for i, (rid, p) in enumerate(prompts.items())]
        return await asyncio.wait_for(asyncio.gather(*jobs), 60)

    try:
        results = asyncio.run(main())
        for _ in range(200):  # the aborts reach the engine thread
            if not engine.has_unfinished():
                break
            asyncio.run(asyncio.sleep(0.01))
    finally:
        aengine.shutdown()
    for i, ((tokens, finals), prompt) in enumerate(zip(results, prompts.values())):
        want = reference_output(prompt, 15)
        if i % 3 == 0:
            assert tokens == want[: len(tokens)] and len(tokens) >= 4
        else:
            assert tokens == want and finals == 1
    assert any(launches)
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
