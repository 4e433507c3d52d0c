"""Sliding-window block freeing through the churn a server sees: requests arriving while others
run, aborts, several adapters and cache salts (separate prefix-cache roots), identical prompts
side by side (n > 1), prompt-logprob sequences (no prefix hits) and prefix-cache resets, on
random block sizes and windows (smaller than a block, whole blocks, neither). After every step
the block manager's state is checked against a brute-force recount: each block's reference
count is the number of running tables holding it, each table's freed entries are exactly the
rule's, and free blocks are what nobody holds; outputs equal the unpaged windowed reference (the
fake paged runner reads back every key each chunk attends to) and nothing leaks."""

from __future__ import annotations

import random

import pytest

from loraplex.engine.block_manager import FREED_BLOCK
from tests.engine.scheduler_harness import Harness, reference_output


def check_block_state(h: Harness) -> None:
    bm = h.block_manager
    refs = [0] * bm.num_blocks
    for seq in h.scheduler.running:
        for block in seq.block_table:
            if block != FREED_BLOCK:
                refs[block] += 1
        # entry i is freed iff no key a chunk from num_computed_tokens on attends to is in it
        first_read = max(0, seq.num_computed_tokens - bm.sliding_window + 1)
        kept = [(i + 1) * bm.block_size > first_read for i in range(len(seq.block_table))]
        assert [b != FREED_BLOCK for b in seq.block_table] == kept
    assert all(not s.block_table for s in h.scheduler.waiting)
    assert [bm.ref_count(b) for b in range(bm.num_blocks)] == refs
    assert bm.num_free_blocks == sum(1 for r in refs if r == 0)


@pytest.mark.parametrize("seed", range(12))
def test_churn_keeps_blocks_exact(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    window = rng.choice([1, 2, block_size, 2 * block_size, 3 * block_size + 1, 7])
    num_blocks = rng.randint(8, 30)
    h = Harness(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=rng.choice([4, 16, 64]),
                max_num_seqs=rng.randint(2, 6), sliding_window=window, enable_prefix_caching=rng.random() < 0.8)
    bases = [[rng.randrange(97) for _ in range(30)] for _ in range(3)]
    expected, aborted = {}, set()
    to_add = 10
    while to_add or h.scheduler.has_unfinished():
        if to_add and rng.random() < 0.4:
            to_add -= 1
            prompt = rng.choice(bases)[: rng.randint(1, 30)] + [rng.randrange(97) for _ in range(rng.randint(0, 8))]
            prompt = prompt[: num_blocks * block_size // 2]
            adapter, max_tokens = rng.choice([None, None, "a", "b"]), rng.randint(1, 30)
            salt = rng.choice([None, None, "x"])
            for _ in range(rng.choice([1, 1, 2, 3])):  # n > 1: the same prompt side by side
                seq = h.add(prompt, adapter_id=adapter, max_tokens=max_tokens)
                seq.cache_salt = salt
                if rng.random() < 0.15:
                    seq.params.prompt_logprobs = 1  # never finished by the fake runner: no hits
                expected[seq.seq_id] = reference_output(prompt, max_tokens, adapter, sliding_window=window)
        if not h.scheduler.has_unfinished():
            continue
        h.step()
        check_block_state(h)
        if rng.random() < 0.05:
            victim = rng.choice(list(h.scheduler._seqs.values()))
            h.scheduler.abort(victim.request_id)
            aborted.add(victim.seq_id)
            check_block_state(h)
        if rng.random() < 0.03:
            h.block_manager.reset_prefix_cache()
            check_block_state(h)
    for seq in h.seqs:
        want = expected[seq.seq_id]
        assert seq.output_token_ids == (want[: seq.num_output_tokens] if seq.seq_id in aborted else want)
    assert h.block_manager.num_free_blocks == num_blocks
