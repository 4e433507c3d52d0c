"""Layer groups over one page pool (kv_layout, block_manager): how layers are grouped, what a long
sequence of a Gemma-3-like model holds, prefix hits that need every global group's blocks but
only the windowed groups' read blocks, and a churn of requests, aborts, adapters, salts, resets
and preemption checked after every step against a brute-force recount of every group's table
(the fake runner reads each group's keys back through its own table)."""

from __future__ import annotations

import random

import pytest

from loraplex.engine.block_manager import FREED_BLOCK, BlockManager, _cache_key, peak_blocks_per_sequence
from loraplex.engine.kv_layout import KVLayout
from loraplex.engine.sequence import Sequence
from loraplex.sampling_params import SamplingParams
from tests.engine.scheduler_harness import Harness, reference_output

S, F = 1024, None  # a Gemma 3 windowed layer, a global one


def gemma3_windows(num_layers: int, window: int = S) -> list[int | None]:
    """transformers' Gemma 3 default pattern: every sixth layer global."""
    return [None if (i + 1) % 6 == 0 else window for i in range(num_layers)]


def test_layers_are_grouped_by_window_into_equal_groups():
    # Gemma 3 27B: 62 layers, 10 global; groups of 6 pad 4 positions (10 would pad 8)
    layout = KVLayout.from_layer_windows(gemma3_windows(62))
    assert layout.group_size == 6 and layout.group_windows == (F, F) + (S,) * 9
    # Gemma 2: alternate layers windowed, one group of each kind
    gemma2 = KVLayout.from_layer_windows([4096, None] * 13)
    assert gemma2.group_size == 13 and gemma2.group_windows == (None, 4096)
    # every layer sits at a distinct (group, slot), in its own kind's group
    for windows in (gemma3_windows(62), gemma3_windows(26), [4096, None] * 13, [7, None, 7, 7, 5, None, 7]):
        layout = KVLayout.from_layer_windows(windows)
        places = list(zip(layout.layer_group, layout.layer_slot))
        assert len(set(places)) == len(windows)
        assert all(layout.group_windows[g] == w for (g, _), w in zip(places, windows))
        assert all(0 <= slot < layout.group_size for _, slot in places)
        padding = layout.num_groups * layout.group_size - len(windows)
        assert padding <= len(windows) // 10


@pytest.mark.parametrize("windows", [[None] * 5, [12] * 5])
def test_models_without_mixed_windows_are_one_group_of_every_layer(windows):
    layout = KVLayout.from_layer_windows(windows)
    assert layout == KVLayout.single(5, windows[0])
    assert layout.group_size == 5 and layout.layer_slot == (0, 1, 2, 3, 4)
    for length in (1, 100, 4097):
        for chunk in (None, 64):
            assert layout.peak_pages_per_sequence(length, 16, chunk) == peak_blocks_per_sequence(
                length, 16, windows[0], chunk)


def test_longest_context_within_is_the_largest_that_fits():
    layout = KVLayout.from_layer_windows([None, 10, 10, None, 10])
    for chunk in (None, 8):
        for pages in range(0, 40):
            got = layout.longest_context_within(pages, 500, 4, chunk)
            fits = [n for n in range(0, 501) if layout.peak_pages_per_sequence(n, 4, chunk) <= pages]
            assert got == max(fits)


def _seq(seq_id: int, prompt: list[int]) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=str(seq_id), prompt_token_ids=prompt, params=SamplingParams())


def test_a_long_sequence_holds_global_context_and_windowed_windows_only():
    """A Gemma-3-like layout (1 global group, 5 windowed) decoding a 32k context: the global
    group holds every block, each windowed group its window's."""
    block, window = 16, 1024
    layout = KVLayout.from_layer_windows(gemma3_windows(6, window))
    bm = BlockManager(4096, block, group_windows=layout.group_windows)
    seq = _seq(0, list(range(32_000)))
    bm.allocate(seq, 2048)  # the first chunk
    while seq.num_computed_tokens + 2048 < seq.num_tokens:
        seq.num_computed_tokens += 2048
        bm.append(seq, 2048)
    seq.num_computed_tokens += 2048
    bm.release_out_of_window(seq)
    n = seq.num_computed_tokens
    window_blocks = -(-(window - 1) // block) + 1  # the blocks the next token's window touches
    held = [sum(b != FREED_BLOCK for b in t) for t in seq.block_tables]
    assert held[0] == -(-n // block)  # global: all of it
    assert all(h <= window_blocks for h in held[1:])
    assert bm.num_free_blocks == bm.num_blocks - sum(held)
    assert sum(held) <= -(-n // block) + 5 * window_blocks
    bm.free(seq)
    assert bm.num_free_blocks == bm.num_blocks


def test_prefix_hit_needs_every_global_groups_blocks_and_the_windowed_read_blocks():
    block, window = 4, 6
    bm = BlockManager(64, block, enable_prefix_caching=True, group_windows=(None, window))
    prompt = list(range(40))
    a = _seq(0, prompt)
    bm.allocate(a, 40)
    global_table, windowed_table = list(a.block_tables[0]), list(a.block_tables[1])
    a.num_computed_tokens = 40
    bm.release_out_of_window(a)
    assert a.block_tables[1][:8] == [FREED_BLOCK] * 8  # keys from 40 - 6 + 1 = 35 on
    assert a.block_tables[0] == global_table
    bm.free(a)
    b = _seq(1, prompt + [99])
    assert bm.num_cached_prefix_tokens(b) == 40  # both groups registered all ten blocks
    # the global group loses block 3: the hit stops before it, whatever the windowed group has
    bm._unregister(global_table[3])
    assert bm.num_cached_prefix_tokens(b) == 12
    # ... and the windowed group's head blocks are not needed: only those the first chunk reads
    bm._unregister(windowed_table[0])
    assert bm.num_cached_prefix_tokens(b) == 12
    bm.allocate(b, 29)
    # a 12-token hit's first chunk reads keys from 12 - 6 + 1 = 7 on: block 1 onwards
    assert b.block_tables[1][:3] == [FREED_BLOCK] + windowed_table[1:3]
    assert b.block_tables[0][:3] == global_table[:3]
    assert bm.ref_count(global_table[0]) == 1 and bm.ref_count(windowed_table[0]) == 0
    # a windowed block the first chunk reads is missing: a 3-block hit reads block 2, a 2- or
    # 1-block hit block 0 (b's blocks 3.. were never computed, so not cached)
    bm.free(b)
    bm._unregister(windowed_table[2])
    assert bm.num_cached_prefix_tokens(_seq(2, prompt + [99])) == 0
    assert bm.num_free_blocks == 64


def check_group_state(h: Harness, group_windows) -> None:
    bm = h.block_manager
    refs = [0] * bm.num_blocks
    for seq in h.scheduler.running:
        assert len({len(t) for t in seq.block_tables}) == 1  # every group's table the same length
        for window, table in zip(group_windows, seq.block_tables):
            for b in table:
                if b != FREED_BLOCK:
                    refs[b] += 1
            first_read = 0 if window is None else max(0, seq.num_computed_tokens - window + 1)
            kept = [(i + 1) * bm.block_size > first_read for i in range(len(table))]
            assert [b != FREED_BLOCK for b in table] == kept
    assert all(not any(s.block_tables) for s in h.scheduler.waiting)
    assert [bm.ref_count(b) for b in range(bm.num_blocks)] == refs
    assert bm.num_free_blocks == sum(1 for r in refs if r == 0)


@pytest.mark.parametrize("seed", range(12))
def test_churn_over_groups_keeps_pages_exact(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    window = rng.choice([1, 2, block_size, 2 * block_size, 3 * block_size + 1, 7])
    group_windows = rng.choice([(None, window), (None, window, window), (window, None, window + 3), (None, None, window)])
    num_blocks = rng.randint(16, 60)
    h = Harness(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=rng.choice([4, 16, 64]),
                max_num_seqs=rng.randint(2, 6), group_windows=group_windows,
                enable_prefix_caching=rng.random() < 0.8)
    bases = [[rng.randrange(97) for _ in range(30)] for _ in range(3)]
    expected, aborted = {}, set()
    to_add = 10
    while to_add or h.scheduler.has_unfinished():
        if to_add and rng.random() < 0.4:
            to_add -= 1
            prompt = rng.choice(bases)[: rng.randint(1, 30)] + [rng.randrange(97) for _ in range(rng.randint(0, 8))]
            # a sequence's whole context in every global group fits the pool
            prompt = prompt[: num_blocks * block_size // (2 * len(group_windows))]
            adapter, max_tokens = rng.choice([None, None, "a", "b"]), rng.randint(1, 8)
            salt = rng.choice([None, None, "x"])
            for _ in range(rng.choice([1, 1, 2, 3])):
                seq = h.add(prompt, adapter_id=adapter, max_tokens=max_tokens)
                seq.cache_salt = salt
                if rng.random() < 0.15:
                    seq.params.prompt_logprobs = 1
                expected[seq.seq_id] = reference_output(prompt, max_tokens, adapter)
        if not h.scheduler.has_unfinished():
            continue
        h.step()
        check_group_state(h, group_windows)
        if rng.random() < 0.05:
            victim = rng.choice(list(h.scheduler._seqs.values()))
            h.scheduler.abort(victim.request_id)
            aborted.add(victim.seq_id)
            check_group_state(h, group_windows)
        if rng.random() < 0.03:
            h.block_manager.reset_prefix_cache()
            check_group_state(h, group_windows)
    for seq in h.seqs:
        want = expected[seq.seq_id]
        assert seq.output_token_ids == (want[: seq.num_output_tokens] if seq.seq_id in aborted else want)
    assert h.block_manager.num_free_blocks == num_blocks


def expected_hit_blocks(bm: BlockManager, seq: Sequence) -> int:
    """The rule over groups: the most leading full blocks k (leaving a token to compute) such
    that every global group has blocks 0..k-1 cached and every windowed group the blocks a chunk
    starting at k * block_size reads, and at least the last one."""
    bs = bm.block_size
    limit = (seq.num_tokens - 1) // bs
    hashes = bm._block_hashes(seq, limit)

    def cached(group: int, block: int) -> bool:
        return _cache_key(hashes[block], group) in bm._cached

    for k in range(limit, 0, -1):
        ok = True
        for g, window in enumerate(bm.group_windows):
            first = 0 if window is None else min(max(0, k * bs - window + 1) // bs, k - 1)
            ok = ok and all(cached(g, j) for j in range(first, k))
        if ok:
            return k
    return 0


def test_cached_prefix_is_the_rule_on_random_states():
    rng = random.Random(8)
    for trial in range(300):
        bs = rng.choice([1, 2, 4])
        w = rng.choice([1, 2, 5, 8, 13])
        windows = rng.choice([(None, w), (w, None, w), (None, None, w + 2), (w, w + 3)])
        bm = BlockManager(num_blocks=rng.randint(12, 60), block_size=bs, enable_prefix_caching=True,
                          group_windows=windows)
        base = [rng.randrange(4) for _ in range(40)]
        for i in range(rng.randint(1, 8)):  # sequences that ran, some still running, evicting others
            s = _seq(i, base[: rng.randint(1, 40)] + [rng.randrange(4) for _ in range(rng.randint(0, 6))])
            n = s.num_tokens - bm.num_cached_prefix_tokens(s)
            if not bm.can_allocate(s, n):
                break
            bm.allocate(s, n)
            s.num_computed_tokens = s.num_tokens
            bm.release_out_of_window(s)
            if rng.random() < 0.5:
                bm.free(s)
        new = _seq(99, base[: rng.randint(1, 40)] + [rng.randrange(4) for _ in range(rng.randint(1, 6))])
        assert bm.num_cached_prefix_tokens(new) == expected_hit_blocks(bm, new) * bs, trial
