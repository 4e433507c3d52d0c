"""Adapter-aware scheduling: the max_loras invariant, readiness gating, and the starvation bound."""

from __future__ import annotations

import random

from tests.engine.scheduler_harness import Harness, reference_output


class FakeGate:
    """AdapterGate stand-in: some adapters not loaded yet, some pinned."""

    def __init__(self, not_ready=(), pinned=()):
        self.not_ready = set(not_ready)
        self.pinned = set(pinned)

    def is_ready(self, adapter_id: str) -> bool:
        return adapter_id not in self.not_ready

    def num_reserved_slots(self, running: set[str]) -> int:
        return len(self.pinned - running)


def adapter(name: str) -> str:
    return name * 64  # stands in for a content sha256


def test_max_loras_invariant_with_pinned_slot():
    rng = random.Random(3)
    gate = FakeGate(pinned={adapter("p")})
    h = Harness(num_blocks=200, block_size=4, max_loras=3, gate=gate, max_num_batched_tokens=48)
    names = [adapter(c) for c in "abcdef"] + [None]
    seqs = []
    for _ in range(40):
        prompt = [rng.randrange(97) for _ in range(rng.randint(1, 20))]
        seqs.append((h.add(prompt, adapter_id=rng.choice(names), max_tokens=rng.randint(1, 8)), prompt))
    max_seen = 0
    while h.scheduler.has_unfinished():
        out = h.step()
        running = h.scheduler.running_adapters()
        step_adapters = {e.adapter_id for e in out.scheduled if e.adapter_id is not None}
        # one slot is reserved by the pinned adapter "p", which nothing uses
        assert len(running) <= 3 - 1
        assert len(step_adapters) <= 2
        max_seen = max(max_seen, len(running))
    assert max_seen == 2
    for seq, prompt in seqs:
        assert seq.output_token_ids == reference_output(prompt, seq.params.max_tokens, seq.adapter_id)


def test_pinned_adapter_in_use_does_not_reserve_extra_slot():
    gate = FakeGate(pinned={adapter("a")})
    h = Harness(max_loras=2, gate=gate)
    a = h.add([1, 2], adapter_id=adapter("a"), max_tokens=6)
    b = h.add([3, 4], adapter_id=adapter("b"), max_tokens=6)
    h.step()
    assert a.status.value == "running" and b.status.value == "running"


def test_adapter_not_ready_waits_without_blocking_others():
    gate = FakeGate(not_ready={adapter("x")})
    h = Harness(max_loras=2, gate=gate)
    blocked = h.add([1, 2, 3], adapter_id=adapter("x"), max_tokens=3)
    behind = [h.add([4, i], adapter_id=adapter("y"), max_tokens=3) for i in range(3)]
    base = h.add([7], max_tokens=3)
    for _ in range(5):
        h.step()
    assert all(s.is_finished for s in behind) and base.is_finished
    assert blocked.status.value == "waiting" and blocked.num_output_tokens == 0
    gate.not_ready.clear()  # the host load finished
    h.run()
    assert blocked.output_token_ids == reference_output([1, 2, 3], 3, adapter("x"))


def test_starvation_bound_under_popular_adapter_flood():
    """One popular adapter floods the queue with long requests, one slot: a request for another
    adapter must get the slot within ``lora_starvation_steps`` steps of arriving."""
    bound = 6
    h = Harness(num_blocks=400, block_size=4, max_loras=1, max_num_batched_tokens=64, lora_starvation_steps=bound)
    popular = adapter("p")
    for i in range(4):
        h.add([i + 1] * 5, adapter_id=popular, max_tokens=200)
    for _ in range(3):
        h.step()
    rare = h.add([9, 9, 9], adapter_id=adapter("r"), max_tokens=4)
    arrival_step = len(h.runner.steps)
    base = h.add([8], max_tokens=2)  # base-model requests are never held back
    admitted_at = None
    for _ in range(40):
        h.add([5] * 5, adapter_id=popular, max_tokens=200)  # the flood keeps coming
        out = h.step()
        if admitted_at is None and any(e.seq is rare for e in out.scheduled):
            admitted_at = len(h.runner.steps)
    assert admitted_at is not None
    assert admitted_at - arrival_step <= bound + 1
    assert h.scheduler.stats.num_starvation_preemptions > 0
    assert base.is_finished
    h.run(max_steps=20_000)
    assert rare.output_token_ids == reference_output([9, 9, 9], 4, adapter("r"))
    assert h.block_manager.num_free_blocks == 400


def test_starving_request_gets_slot_when_running_adapter_drains():
    """With short requests the running adapter drains before the bound: no preemption needed."""
    h = Harness(num_blocks=200, block_size=4, max_loras=1, lora_starvation_steps=50)
    popular = adapter("p")
    for i in range(3):
        h.add([i + 1], adapter_id=popular, max_tokens=3)
    h.step()
    rare = h.add([9], adapter_id=adapter("r"), max_tokens=2)
    later_popular = h.add([4], adapter_id=popular, max_tokens=2)
    steps = 0
    while rare.num_output_tokens == 0:
        h.step()
        steps += 1
    assert steps <= 4
    assert h.scheduler.stats.num_starvation_preemptions == 0
    assert later_popular.first_token_time is None or later_popular.first_token_time >= rare.first_token_time
    h.run()
