"""The scheduler with WaitingQueue and RunningSet against the list-based scheduler it replaced
(list_scheduler.py), step by step over random workloads: tenants with weights that change
mid-run, priorities, tied arrivals, adapters that become ready late and a pinned one, tight KV
(preemptions), few adapter slots (starvation preemptions) and aborts. Every step must schedule
the same sequences with the same tokens, release the same ones and report the same counts."""

from __future__ import annotations

import random

import pytest

from tests.engine.list_scheduler import ListScheduler
from tests.engine.scheduler_harness import Harness, reference_output
from tests.engine.test_scheduler_lora import FakeGate, adapter

ADAPTERS = [adapter(c) for c in "abcd"] + [None, None]


def _pair(policy: str, rng: random.Random):
    config = dict(num_blocks=rng.choice([12, 20, 40]), block_size=4, max_num_seqs=rng.choice([3, 6, 16]),
                  max_num_batched_tokens=rng.choice([16, 32, 64]), max_loras=rng.choice([1, 2, 3]),
                  scheduling_policy=policy, lora_starvation_steps=rng.choice([2, 5]),
                  enable_chunked_prefill=rng.random() < 0.7)
    # a pinned adapter that nothing runs holds one slot: with one slot, the others would never run
    pinned = {adapter("d")} if config["max_loras"] > 1 and rng.random() < 0.5 else set()
    gates = FakeGate(not_ready={adapter("c")}, pinned=pinned), FakeGate(not_ready={adapter("c")}, pinned=pinned)
    new, old = Harness(gate=gates[0], **config), Harness(gate=gates[1], **config)
    old.scheduler = ListScheduler(old.config, old.block_manager, gates[1])
    return new, old, gates


def _drive(policy: str, seed: int):
    """Run one random workload through both schedulers, comparing each step; the new one's stats."""
    rng = random.Random(f"{policy}-{seed}")
    new, old, gates = _pair(policy, rng)
    weights = {"a": 1.0, "b": 2.0, "c": 0.5, None: 1.0}
    for step in range(3000):
        for _ in range(rng.choice([0, 0, 1, 3]) if step < 150 else 0):
            if rng.random() < 0.05:
                weights[rng.choice("abc")] = rng.choice([0.5, 1.0, 3.0])
            tie = rng.random() < 0.3
            kwargs = dict(prompt=[rng.randrange(97) for _ in range(rng.randint(1, 14))],
                          adapter_id=rng.choice(ADAPTERS), tenant=rng.choice(["a", "b", "c", None]),
                          priority=rng.choice([0, 0, -1, 3]) if policy != "fcfs" else 0,
                          max_tokens=rng.randint(1, 10))
            kwargs["tenant_weight"] = weights[kwargs["tenant"]]
            for h in (new, old):
                h.time -= 1.0 if tie and h.seqs else 0.0  # the same arrival time as the previous one
                h.add(**kwargs)
        if step == 40:
            for gate in gates:
                gate.not_ready.clear()  # adapter c is read in
        if rng.random() < 0.04 and new.seqs:
            request_id = rng.choice(new.seqs).request_id
            assert [s.seq_id for s in new.scheduler.abort(request_id)] == [
                s.seq_id for s in old.scheduler.abort(request_id)]
        if not new.scheduler.has_unfinished():
            if step >= 150:
                break
            continue
        got, want = new.step(), old.step()
        assert [(e.seq.seq_id, e.start_pos, e.num_tokens) for e in got.scheduled] == [
            (e.seq.seq_id, e.start_pos, e.num_tokens) for e in want.scheduled], step
        assert (got.released_seq_ids, got.num_preempted) == (want.released_seq_ids, want.num_preempted)
        assert new.scheduler.num_waiting == old.scheduler.num_waiting
        assert [s.seq_id for s in new.scheduler.waiting] == [s.seq_id for s in old.scheduler.waiting]
        assert new.scheduler.stats == old.scheduler.stats
    assert not old.scheduler.has_unfinished()
    for seq in new.seqs:
        if seq.finish_reason != "abort":
            assert seq.output_token_ids == reference_output(seq.prompt_token_ids, seq.params.max_tokens,
                                                            seq.adapter_id)
    assert new.block_manager.num_free_blocks == new.block_manager.num_blocks
    assert new.scheduler.num_waiting == 0 and len(new.scheduler.running) == 0
    return new.scheduler.stats


SEEDS = range(6)


@pytest.mark.parametrize("policy", ["fair", "fcfs", "priority"])
@pytest.mark.parametrize("seed", SEEDS)
def test_steps_match_the_list_based_scheduler(policy, seed):
    _drive(policy, seed)


def test_the_workloads_preempt_for_kv_and_for_starving_adapters():
    stats = [_drive("fair", seed) for seed in SEEDS]
    assert sum(s.num_preemptions - s.num_starvation_preemptions for s in stats) > 0
    assert sum(s.num_starvation_preemptions for s in stats) > 0
