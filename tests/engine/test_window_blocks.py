"""Sliding-window KV freeing in the block manager and scheduler, driven with the fake paged
runner (scheduler_harness): the runner reads back every key each chunk attends to, so a block
freed too early (and reused by another sequence) shows up as a wrong context, and outputs are
checked against the unpaged windowed reference."""

from __future__ import annotations

import copy
import random

import pytest

from loraplex.engine.block_manager import FREED_BLOCK, BlockManager
from loraplex.engine.sequence import Sequence
from loraplex.sampling_params import SamplingParams
from tests.engine.scheduler_harness import Harness, reference_output


def expected_table_shape(computed: int, table_len: int, window: int, block_size: int) -> list[bool]:
    """The rule, stated by position: entry i is kept iff some position of block i is still read
    by a query at position >= computed, i.e. its last position i * bs + bs - 1 > computed - window."""
    return [i * block_size + block_size - 1 > computed - window for i in range(table_len)]


def held(seq: Sequence) -> list[int]:
    return [b for b in seq.block_table if b != FREED_BLOCK]


def run_checked(h: Harness, window: int, block_size: int) -> int:
    """Run to the end, checking after every step which entries each running sequence keeps and
    that the free count is what they hold (without prefix caching). Returns the most held."""
    most = 0
    while h.scheduler.has_unfinished():
        h.step()
        for seq in h.scheduler.running:
            kept = [b != FREED_BLOCK for b in seq.block_table]
            assert kept == expected_table_shape(seq.num_computed_tokens, len(kept), window, block_size)
            # between steps a sequence holds the window before its next token, no more
            assert len(held(seq)) <= -(-(window - 1) // block_size) + 1
            most = max(most, len(held(seq)))
        if not h.config.enable_prefix_caching:
            in_use = sum(len(held(s)) for s in h.scheduler.running)
            assert h.block_manager.num_free_blocks == h.block_manager.num_blocks - in_use
    return most


@pytest.mark.parametrize("window,block_size", [(8, 4), (6, 4), (1, 4), (9, 3), (4, 4)])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_blocks_slide_out_and_outputs_stay_exact(window, block_size, prefix_caching):
    rng = random.Random(window * 10 + block_size)
    shared = [rng.randrange(97) for _ in range(13)]  # prefix hits (when on) past the window
    prompts = [shared + [rng.randrange(97) for _ in range(rng.randint(1, 40))] for _ in range(10)]
    # 30 blocks would hold one 100-token sequence whole; here ten of them run together
    h = Harness(num_blocks=30, block_size=block_size, max_num_batched_tokens=16, max_num_seqs=6,
                sliding_window=window, enable_prefix_caching=prefix_caching)
    seqs = [h.add(p, max_tokens=50) for p in prompts]
    run_checked(h, window, block_size)
    for seq, prompt in zip(seqs, prompts):
        assert seq.output_token_ids == reference_output(prompt, 50, sliding_window=window)
    assert h.block_manager.num_free_blocks == h.block_manager.num_blocks  # nothing leaked


def test_more_long_sequences_run_together_on_the_same_kv():
    rng = random.Random(3)
    prompts = [[rng.randrange(97) for _ in range(60)] for _ in range(8)]

    def most_running(window):
        h = Harness(num_blocks=40, block_size=4, max_num_batched_tokens=64, max_num_seqs=8, sliding_window=window)
        seqs = [h.add(p, max_tokens=40) for p in prompts]
        most = 0
        while h.scheduler.has_unfinished():
            h.step()
            most = max(most, h.scheduler.num_running)
        assert [s.output_token_ids for s in seqs] == [reference_output(p, 40, sliding_window=window) for p in prompts]
        return most, h.scheduler.stats.num_preemptions

    # 100 tokens = 25 blocks each: kept whole, 40 blocks cannot hold two to the end
    most, preemptions = most_running(None)
    assert most < 8 and preemptions > 0
    # with an 8-token window each holds at most 3 blocks plus the chunk it computes
    assert most_running(8) == (8, 0)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preempted_sequences_recompute_and_match(prefix_caching):
    rng = random.Random(7)
    prompts = [[rng.randrange(97) for _ in range(rng.randint(20, 50))] for _ in range(6)]
    h = Harness(num_blocks=12, block_size=4, max_num_batched_tokens=32, max_num_seqs=6, sliding_window=8,
                enable_prefix_caching=prefix_caching)
    seqs = [h.add(p, max_tokens=30) for p in prompts]
    run_checked(h, 8, 4)
    assert h.scheduler.stats.num_preemptions > 0
    for seq, prompt in zip(seqs, prompts):
        assert seq.output_token_ids == reference_output(prompt, 30, sliding_window=8)
    assert h.block_manager.num_free_blocks == 12


def _seq(i: int, prompt: list[int]) -> Sequence:
    return Sequence(seq_id=i, request_id=f"r{i}", prompt_token_ids=prompt, params=SamplingParams())


def test_prefix_hit_takes_only_the_blocks_it_reads():
    """Blocks that slid out of a running sequence's window stay cached (evictable); a new
    sequence with the same prefix counts them as computed but holds only its window's."""
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True, sliding_window=6)
    prompt = list(range(10, 31))  # 21 tokens: five full blocks and one
    a = _seq(0, prompt)
    bm.allocate(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    assert bm.release_out_of_window(a) == 4  # keys from 21 - 6 + 1 = 16 on: block 4 onwards
    assert a.block_table[:4] == [FREED_BLOCK] * 4
    assert bm.num_free_blocks == 16 - 2  # the released blocks count as free ...
    b = _seq(1, prompt + [99])
    assert bm.num_cached_prefix_tokens(b) == 20  # ... and are still found as b's prefix
    bm.allocate(b, 2)
    assert b.num_computed_tokens == 20
    # b's first query (position 20) reads keys 15..20: blocks 3, 4, 5 only
    assert b.block_table[:3] == [FREED_BLOCK] * 3
    assert b.block_table[3:5] == [bm._cached[h] for h in b.block_hashes[3:5]]
    assert [bm.ref_count(x) for x in b.block_table[3:5]] == [1, 2]  # block 3 had slid out of a's window
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_can_allocate_and_can_append_agree_with_trying():
    """Admission counts what a sequence will hold: brute force, try each on a copy."""
    rng = random.Random(11)
    for trial in range(300):
        bm = BlockManager(num_blocks=rng.randint(4, 14), block_size=4, enable_prefix_caching=rng.random() < 0.7,
                          sliding_window=rng.choice([1, 5, 8, 13]))
        base = [rng.randrange(5) for _ in range(rng.randint(1, 30))]
        seqs = []
        for i in range(rng.randint(1, 4)):  # some sequences, some finished (their cached blocks stay)
            s = _seq(i, base[: rng.randint(1, len(base))] + [rng.randrange(5) for _ in range(rng.randint(0, 9))])
            n = rng.randint(1, s.num_tokens - bm.num_cached_prefix_tokens(s))
            if not bm.can_allocate(s, n):
                continue
            bm.allocate(s, n)
            s.num_computed_tokens += n  # the step ran
            if rng.random() < 0.5:  # as the scheduler's update does; else append will
                bm.release_out_of_window(s)
            if rng.random() < 0.4:
                bm.free(s)
            else:
                seqs.append(s)
        new = _seq(99, base + [rng.randrange(5) for _ in range(rng.randint(1, 9))])
        n = rng.randint(1, max(1, new.num_tokens - bm.num_cached_prefix_tokens(new)))
        assert bm.can_allocate(new, n) == _succeeds(bm, lambda m, ss: m.allocate(ss[-1], n), seqs + [new])
        for k, s in enumerate(seqs):
            m = rng.randint(1, 12)
            s.prompt_token_ids += [rng.randrange(5) for _ in range(max(0, s.num_computed_tokens + m - s.num_tokens))]
            assert bm.can_append(s, m) == _succeeds(bm, lambda mm, ss: mm.append(ss[k], m), seqs + [new])


def _succeeds(bm: BlockManager, action, seqs: list[Sequence]) -> bool:
    bm2, seqs2 = copy.deepcopy((bm, seqs))
    try:
        action(bm2, seqs2)
    except RuntimeError:
        return False
    return True
