"""Prefix caching under a sliding window: a new sequence needs cached only the blocks its first
chunk reads (from its first query's window on), not the whole chain from block 0. A windowed
sequence gives its head blocks back first, so they are the least recently used and evicted
first: a lookup that walks from block 0 then finds nothing though the window's blocks are held.
Checked against a brute-force statement of the rule, and end to end with the fake paged runner
(scheduler_harness), which reads back every key each chunk attends to."""

from __future__ import annotations

import random

from loraplex.engine.block_manager import FREED_BLOCK, BlockManager
from loraplex.engine.sequence import Sequence
from loraplex.sampling_params import SamplingParams
from tests.engine.scheduler_harness import Harness, reference_output


def _seq(i: int, prompt: list[int]) -> Sequence:
    return Sequence(seq_id=i, request_id=f"r{i}", prompt_token_ids=prompt, params=SamplingParams())


def _run_prompt(bm: BlockManager, seq: Sequence) -> None:
    """Allocate and compute ``seq``'s whole prompt in one step (as Scheduler.update leaves it)."""
    bm.allocate(seq, seq.num_tokens - bm.num_cached_prefix_tokens(seq))
    seq.num_computed_tokens = seq.num_tokens
    bm.release_out_of_window(seq)


def expected_hit_blocks(bm: BlockManager, seq: Sequence) -> int:
    """The rule: the most leading full blocks k (leaving a token to compute) such that the blocks
    a chunk starting at k * block_size reads, and at least the last one, are all cached."""
    bs, window = bm.block_size, bm.sliding_window
    hashes = bm._block_hashes(seq, (seq.num_tokens - 1) // bs)
    for k in range((seq.num_tokens - 1) // bs, 0, -1):
        first_read = max(0, k * bs - window + 1) // bs  # the block of the first key it attends to
        if all(hashes[j] in bm._cached for j in range(min(first_read, k - 1), k)):
            return k
    return 0


def test_hit_after_the_head_blocks_were_evicted():
    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=True, sliding_window=8)
    prompt = list(range(10, 40))  # 30 tokens: 8 blocks
    a = _seq(0, prompt)
    _run_prompt(bm, a)  # keys from 30 - 8 + 1 = 23 on are read next: blocks 0..4 go back, cached
    assert a.block_table[:5] == [FREED_BLOCK] * 5
    other = _seq(1, list(range(100, 124)))  # 6 blocks: the 4 free ones and A's blocks 0 and 1
    _run_prompt(bm, other)
    b = _seq(2, prompt + [7])
    # b's first query (position 28) reads keys 21..28: blocks 5 and 6, which A still holds
    assert bm.num_cached_prefix_tokens(b) == 28
    bm.allocate(b, 3)
    assert b.num_computed_tokens == 28
    assert b.block_table[:5] == [FREED_BLOCK] * 5 and b.block_table[5:7] == a.block_table[5:7]
    for s in (a, other, b):
        bm.free(s)
    assert bm.num_free_blocks == 12


def test_cached_prefix_is_the_rule_on_random_states():
    rng = random.Random(5)
    for trial in range(300):
        bs = rng.choice([1, 2, 4])
        bm = BlockManager(num_blocks=rng.randint(6, 20), block_size=bs, enable_prefix_caching=True,
                          sliding_window=rng.choice([1, 2, 5, 8, 13]))
        base = [rng.randrange(4) for _ in range(40)]
        held = []
        for i in range(rng.randint(1, 8)):  # sequences that ran, some still running, evicting others
            s = _seq(i, base[: rng.randint(1, 40)] + [rng.randrange(4) for _ in range(rng.randint(0, 6))])
            n = s.num_tokens - bm.num_cached_prefix_tokens(s)
            if not bm.can_allocate(s, n):
                break
            _run_prompt(bm, s)
            if rng.random() < 0.5:
                bm.free(s)
            else:
                held.append(s)
        new = _seq(99, base[: rng.randint(1, 40)] + [rng.randrange(4) for _ in range(rng.randint(1, 6))])
        assert bm.num_cached_prefix_tokens(new) == expected_hit_blocks(bm, new) * bs, trial


def test_shared_long_prefix_under_pressure_stays_exact_and_hits():
    """Requests sharing a prefix four windows long, on a KV pool that evicts: outputs equal the
    windowed reference (every key read back is the right one) and later requests hit the cache."""
    rng = random.Random(2)
    shared = [rng.randrange(97) for _ in range(33)]
    prompts = [shared + [rng.randrange(97) for _ in range(rng.randint(1, 6))] for _ in range(12)]
    # 16 blocks: each request passes through about 15, so the pool evicts all the time, and the
    # prefix's head blocks (never read again by anyone) are always the least recently used
    h = Harness(num_blocks=16, block_size=4, max_num_batched_tokens=40, max_num_seqs=2, sliding_window=8,
                enable_prefix_caching=True)
    seqs = [h.add(p, max_tokens=20) for p in prompts]
    h.run()
    for seq, prompt in zip(seqs, prompts):
        assert seq.output_token_ids == reference_output(prompt, 20, sliding_window=8)
    # every request after the first finds the shared prefix's 8 full blocks: the two its first
    # chunk reads were used last (a walk from block 0 finds nothing once block 0 is evicted)
    assert h.scheduler.stats.num_prefix_hit_tokens >= 11 * 32
    assert h.block_manager.num_free_blocks == 16
