"""Scheduler + block manager, driven with a fake paged runner (see scheduler_harness)."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from tests.engine.scheduler_harness import Harness, reference_output


def random_prompts(rng: random.Random, count: int, max_len: int) -> list[list[int]]:
    return [[rng.randrange(97) for _ in range(rng.randint(1, max_len))] for _ in range(count)]


def test_scheduler_code_imports_no_torch():
    code = (
        "import sys; import loraplex.engine.scheduler, loraplex.engine.block_manager, "
        "loraplex.engine.sequence, loraplex.engine.outputs; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_budgets_respected_outputs_exact_and_all_blocks_free():
    rng = random.Random(0)
    h = Harness(num_blocks=40, block_size=4, max_num_batched_tokens=24, max_num_seqs=5)
    prompts = random_prompts(rng, 20, 40)
    max_tokens = [rng.randint(1, 12) for _ in prompts]
    seqs = [h.add(p, max_tokens=m) for p, m in zip(prompts, max_tokens)]
    h.run()
    for seq, prompt, m in zip(seqs, prompts, max_tokens):
        assert seq.output_token_ids == reference_output(prompt, m)
        assert seq.finish_reason == "length"
    assert h.block_manager.num_free_blocks == h.block_manager.num_blocks
    assert max(s.num_batched_tokens for s in h.runner.steps) == 24  # the budget was actually used


def test_preempted_outputs_equal_unpreempted_run():
    rng = random.Random(1)
    prompts = random_prompts(rng, 12, 30)

    def run(num_blocks):
        h = Harness(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=32)
        seqs = [h.add(p, max_tokens=20) for p in prompts]
        h.run()
        assert h.block_manager.num_free_blocks == num_blocks
        return [s.output_token_ids for s in seqs], h.scheduler.stats.num_preemptions

    roomy, roomy_preempts = run(400)
    tight, tight_preempts = run(14)  # 14 blocks * 4 = 56 tokens for up to 50-token sequences
    assert roomy_preempts == 0 and tight_preempts > 0
    assert tight == roomy
    assert roomy == [reference_output(p, 20) for p in prompts]


def test_preemption_victim_is_most_recently_admitted():
    h = Harness(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    first = h.add([1] * 7, max_tokens=12)
    second = h.add([2] * 7, max_tokens=12)
    while first.num_preemptions == 0 and second.num_preemptions == 0:
        h.step()
    assert second.num_preemptions == 1 and first.num_preemptions == 0
    h.run()
    assert first.output_token_ids == reference_output([1] * 7, 12)
    assert second.output_token_ids == reference_output([2] * 7, 12)


def test_chunked_prefill_shares_steps_with_decodes():
    h = Harness(num_blocks=64, block_size=4, max_num_batched_tokens=16)
    short = h.add([5, 6], max_tokens=30)
    h.step()  # short's prefill
    long = h.add(list(range(90)), max_tokens=3)
    mixed = 0
    while h.scheduler.has_unfinished():
        out = h.step()
        kinds = {e.seq.seq_id: e for e in out.scheduled}
        if short.seq_id in kinds and long.seq_id in kinds:
            assert kinds[short.seq_id].num_tokens == 1  # the decode goes first, whole
            assert out.scheduled[0].seq is short
            if not kinds[long.seq_id].needs_sample:
                mixed += 1
    assert mixed >= 3  # 90-token prompt in 15-token chunks next to a decode
    assert h.scheduler.stats.num_chunked_prefills >= 5
    assert long.output_token_ids == reference_output(list(range(90)), 3)


def test_without_chunked_prefill_prompts_go_whole():
    h = Harness(num_blocks=64, block_size=4, max_num_batched_tokens=40, enable_chunked_prefill=False)
    seqs = [h.add(list(range(n)), max_tokens=4) for n in (30, 30, 5)]
    h.run()
    assert all(e.needs_sample for step in h.runner.steps for e in step.scheduled)
    assert [s.output_token_ids for s in seqs] == [reference_output(list(range(n)), 4) for n in (30, 30, 5)]


def test_abort_mid_decode_frees_blocks_at_once():
    h = Harness(num_blocks=32, block_size=4)
    keep = h.add([1, 2, 3], max_tokens=10)
    victim = h.add(list(range(20)), max_tokens=50)
    for _ in range(4):
        h.step()
    assert victim.num_output_tokens > 0 and victim.block_table
    used_before = h.block_manager.num_blocks - h.block_manager.num_free_blocks
    held = len(victim.block_table)
    h.scheduler.abort(victim.request_id)
    assert h.block_manager.num_blocks - h.block_manager.num_free_blocks == used_before - held
    assert victim.finish_reason == "abort" and not victim.block_table
    h.run()
    assert keep.output_token_ids == reference_output([1, 2, 3], 10)
    assert h.block_manager.num_free_blocks == h.block_manager.num_blocks
    assert victim.seq_id in h.runner.steps[4].released_seq_ids


def test_abort_waiting_request():
    h = Harness(num_blocks=32, block_size=4, max_num_seqs=1)
    h.add([1], max_tokens=5)
    waiting = h.add([2], max_tokens=5)
    h.step()
    h.scheduler.abort(waiting.request_id)
    assert h.scheduler.num_waiting == 0 and waiting.finish_reason == "abort"
    h.run()
    assert h.block_manager.num_free_blocks == 32


@pytest.mark.parametrize(
    "params, eos, expected_len, reason",
    [
        ({"max_tokens": 20, "ignore_eos": False}, "third", 3, "stop"),
        ({"max_tokens": 20, "ignore_eos": True}, "third", 20, "length"),
        ({"max_tokens": 20, "ignore_eos": False, "min_tokens": 5}, "third", 20, "length"),
        ({"max_tokens": 20, "stop_token_ids": "third"}, None, 3, "stop"),
        # an EOS also listed in stop_token_ids: EOS first (vLLM's check_stop), no stop_reason
        ({"max_tokens": 20, "ignore_eos": False, "stop_token_ids": "third"}, "third", 3, "stop"),
        # ignore_eos: the listed EOS is a stop token like any other
        ({"max_tokens": 20, "ignore_eos": True, "stop_token_ids": "third"}, "third", 3, "stop"),
    ],
)
def test_stop_conditions(params, eos, expected_len, reason):
    prompt = [3, 1, 4]
    ref = reference_output(prompt, 20)
    third = ref[2]
    if any(t == third for t in ref[:2]) or (params.get("min_tokens") and third in ref[5:]):
        pytest.skip("fake model repeats the token")  # keeps the expectation unambiguous
    if params.get("stop_token_ids") == "third":
        params = {**params, "stop_token_ids": [third]}
    h = Harness(eos_token_ids=[third] if eos else ())
    seq = h.add(prompt, **params)
    h.run()
    assert seq.output_token_ids == ref[:expected_len]
    assert seq.finish_reason == reason
    if params.get("stop_token_ids"):
        assert seq.stop_reason == (None if eos and not params.get("ignore_eos", True) else third)
    else:
        assert seq.stop_reason is None


def test_max_model_len_caps_generation():
    h = Harness(max_model_len=10)
    seq = h.add([1] * 6, max_tokens=50)
    h.run()
    assert seq.num_tokens == 10 and seq.finish_reason == "length"


def test_prefix_caching_shares_blocks_and_keeps_outputs():
    rng = random.Random(2)
    shared = [rng.randrange(97) for _ in range(24)]
    prompts = [shared + [rng.randrange(97) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    h = Harness(num_blocks=80, block_size=4, enable_prefix_caching=True, max_num_batched_tokens=64)
    first = h.add(prompts[0], max_tokens=5)
    h.run()
    hits_before = h.scheduler.stats.num_prefix_hit_tokens
    seqs = [h.add(p, max_tokens=5, adapter_id=None) for p in prompts[1:]]
    other_adapter = h.add(prompts[1], max_tokens=5, adapter_id="a" * 64)
    h.run()
    assert h.scheduler.stats.num_prefix_hit_tokens - hits_before >= 5 * 24
    assert first.output_token_ids == reference_output(prompts[0], 5)
    for seq, p in zip(seqs, prompts[1:]):
        assert seq.output_token_ids == reference_output(p, 5)
    # another adapter never reuses the base model's KV
    assert other_adapter.output_token_ids == reference_output(prompts[1], 5, "a" * 64)
    assert h.block_manager.num_free_blocks == 80


def test_prefix_shared_within_the_step_that_computes_it():
    # requests that arrive together with a common prefix (a chat template's system prompt)
    # compute it once: the first one's blocks are shared from the step that fills them
    rng = random.Random(5)
    shared = [rng.randrange(97) for _ in range(21)]  # five full blocks of 4, then one partial
    prompts = [shared + [rng.randrange(97) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    h = Harness(num_blocks=80, block_size=4, enable_prefix_caching=True, max_num_batched_tokens=256)
    seqs = [h.add(p, max_tokens=5) for p in prompts]
    first = h.step()
    assert len(first.scheduled) == 6  # all admitted in one step ...
    assert first.num_batched_tokens == sum(map(len, prompts)) - 5 * 20  # ... the prefix computed once
    tables = [s.block_table[:5] for s in seqs]
    assert all(t == tables[0] for t in tables)
    h.run()
    assert h.scheduler.stats.num_prefix_hit_tokens == 5 * 20
    for seq, p in zip(seqs, prompts):
        assert seq.output_token_ids == reference_output(p, 5)
    assert h.block_manager.num_free_blocks == 80


def test_blocks_of_a_step_that_never_ran_are_not_shared():
    from loraplex.engine.block_manager import BlockManager
    from loraplex.engine.sequence import Sequence
    from loraplex.sampling_params import SamplingParams

    def seq(i: int, prompt: list[int]) -> Sequence:
        return Sequence(seq_id=i, request_id=f"r{i}", prompt_token_ids=prompt, params=SamplingParams())

    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = list(range(10, 23))  # three full blocks and one token
    a = seq(0, prompt)
    bm.allocate(a, a.num_tokens)  # scheduled: its full blocks are registered ...
    b = seq(1, prompt)
    assert bm.num_cached_prefix_tokens(b) == 12
    bm.free(a)  # ... but it is preempted in the same pass, before the step computed them
    assert bm.num_cached_prefix_tokens(b) == 0
    assert bm.num_free_blocks == 16
    # once computed (the engine advanced num_computed_tokens) they outlive their sequence
    c = seq(2, prompt)
    bm.allocate(c, c.num_tokens)
    c.num_computed_tokens = c.num_tokens
    bm.free(c)
    assert bm.num_cached_prefix_tokens(b) == 12
    bm.allocate(b, 1)
    assert b.num_computed_tokens == 12
    assert all(bm.ref_count(block) == 1 for block in b.block_table)  # c's, now held by b alone


def test_each_block_is_hashed_once_per_sequence(monkeypatch):
    """A prompt held at the head of the queue for lack of KV is looked up every step; its
    prefix-cache keys are computed once, not per lookup, and outputs stay exact."""
    import loraplex.engine.block_manager as block_manager

    calls = 0
    real_chain_hash = block_manager._chain_hash

    def counting_chain_hash(parent, tokens):
        nonlocal calls
        calls += 1
        return real_chain_hash(parent, tokens)

    monkeypatch.setattr(block_manager, "_chain_hash", counting_chain_hash)
    rng = random.Random(11)
    h = Harness(num_blocks=24, block_size=4, enable_prefix_caching=True, max_num_batched_tokens=64)
    prompts = [[rng.randrange(97) for _ in range(rng.randint(30, 40))] for _ in range(6)]
    seqs = [h.add(p, max_tokens=8) for p in prompts]
    steps = h.run()
    assert steps > 10  # the later prompts waited for KV through many steps
    for seq, p in zip(seqs, prompts):
        assert seq.output_token_ids == reference_output(p, 8)
    # every full block of every sequence (prompt and output) at most once
    assert calls <= sum(s.num_tokens // 4 for s in seqs)
    assert h.block_manager.num_free_blocks == 24


def test_fcfs_order_of_admission():
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=2)
    seqs = [h.add([i + 1] * 3, max_tokens=3) for i in range(6)]
    h.run()
    first_token = [s.first_token_time for s in seqs]
    assert first_token == sorted(first_token)



def test_without_chunked_prefill_a_long_recompute_still_resumes():
    """A preempted sequence whose prompt + output outgrew the step budget is recomputed in
    pieces instead of waiting forever."""
    h = Harness(num_blocks=12, block_size=4, max_num_batched_tokens=20, enable_chunked_prefill=False)
    seqs = [h.add([i + 1] * 18, max_tokens=20) for i in range(2)]
    h.run(max_steps=500)
    assert h.scheduler.stats.num_preemptions > 0
    assert [s.output_token_ids for s in seqs] == [reference_output([i + 1] * 18, 20) for i in range(2)]
