"""``Sequence.num_cached_tokens`` in the scheduler (with the fake paged runner): set at a
sequence's first admission to the tokens it took from the prefix cache, kept through preemption,
and forgotten when the step of that admission never ran."""

from __future__ import annotations

from tests.engine.scheduler_harness import Harness

BLOCK = 4


def test_set_at_the_first_admission_and_kept_through_preemption():
    h = Harness(num_blocks=64, block_size=BLOCK, max_num_batched_tokens=64)
    warm = h.add(list(range(10, 22)), max_tokens=2)  # 12 tokens: three blocks
    h.run()
    assert warm.num_cached_tokens == 0
    seq = h.add(list(range(10, 22)) + [50, 51], max_tokens=6)
    assert seq.num_cached_tokens is None  # not admitted yet
    h.step()
    assert seq.num_cached_tokens == 3 * BLOCK  # the three blocks the warm-up left
    h.step()
    h.scheduler._preempt(seq)  # as memory pressure would: blocks back, recomputed later
    h.step()  # re-admitted: its own blocks (prompt and output so far) are cached
    assert seq.num_computed_tokens > 3 * BLOCK
    assert seq.num_cached_tokens == 3 * BLOCK
    h.run()
    assert seq.num_cached_tokens == 3 * BLOCK


def test_an_admission_whose_step_never_ran_is_counted_again():
    h = Harness(num_blocks=64, block_size=BLOCK, max_num_batched_tokens=64)
    prompt = list(range(30, 39))  # 9 tokens: two full blocks
    first = h.add(prompt, max_tokens=2)
    second = h.add(prompt + [60], max_tokens=2)
    out = h.scheduler.schedule()
    # the second found the blocks the first registered in the same step (not computed yet)
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 2 * BLOCK)
    h.scheduler.requeue_unrun(out)  # the step failed before it ran: those blocks hold nothing
    assert (first.num_cached_tokens, second.num_cached_tokens) == (None, None)
    h.run()
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 2 * BLOCK)
    assert h.block_manager.num_free_blocks == h.block_manager.num_blocks


def test_without_prefix_caching_an_unrun_step_keeps_the_admission():
    """Without prefix caching a step that did not run leaves its sequences running (they run
    again, never re-admitted): their count stays the 0 every request of such an engine gets,
    not None (unknown) for good."""
    h = Harness(num_blocks=64, block_size=BLOCK, max_num_batched_tokens=64, enable_prefix_caching=False)
    plain = h.add(list(range(30, 39)), max_tokens=2)
    h.run()
    assert plain.num_cached_tokens == 0
    seq = h.add(list(range(30, 39)), max_tokens=2)
    out = h.scheduler.schedule()
    assert seq.num_cached_tokens == 0
    h.scheduler.requeue_unrun(out)
    h.run()
    assert seq.num_cached_tokens == 0
    assert h.scheduler.stats.num_prefix_query_tokens == h.scheduler.stats.num_prefix_hit_tokens == 0
