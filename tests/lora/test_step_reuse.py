"""A step of the same adapters in the same order as the last one reuses its placement and token
slots (``LoRAManager.place`` / ``step_slots``) while the pool's slots stand (``SlotPool.generation``).

Checked against the manager's full path (the same manager class with its memo cleared before
every call) over random histories of repeated and changed batches, unloads, warm-ups and admin
loads that move adapters between slots: the same slots, the same LRU stamps, the same loads.
"""

from __future__ import annotations

import random

import torch

from loraplex.config import EngineConfig
from loraplex.lora.manager import LoRAManager


def _manager(spec) -> LoRAManager:
    return LoRAManager(spec, EngineConfig(max_loras=3, max_lora_rank=8), "cpu", torch.float32)


def _state(m: LoRAManager) -> dict:
    pool = m.pool
    return {
        "slots": list(pool.adapter_in),
        "ranks": list(pool.slot_rank_host),
        "last_used": list(pool._last_used),
        "loads": {a: s["loads"] for a, s in m.stats()["adapters"].items()},
    }


def test_generation_counts_slot_changes(lora_base, make_adapter):
    m = _manager(lora_base.spec)
    a, b = (m.register(n, make_adapter(n, seed=i)) for i, n in enumerate("ab"))
    pool = m.pool
    start = pool.generation
    m.place([a, None, a])
    assert pool.generation == start + 1
    m.place([a, a])  # resident: nothing written
    m.pool.clear(pool.free_slot())  # an empty slot: nothing changes
    assert pool.generation == start + 1
    m.place([b])
    m.unload(a)
    assert pool.generation == start + 3


def test_reused_steps_match_the_full_path(lora_base, make_adapter):
    names = "abcde"
    paths = {n: make_adapter(n, seed=i, r=1 + i) for i, n in enumerate(names)}
    cached, full = _manager(lora_base.spec), _manager(lora_base.spec)
    ids = {n: [m.register(n, p) for m in (cached, full)] for n, p in paths.items()}
    assert all(x == y for x, y in ids.values())  # content ids: the same in both
    adapters = [x for x, _ in ids.values()]
    rng = random.Random(7)
    batch: list = [None]
    reused = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.08:
            victim = rng.choice(adapters)
            for m in (cached, full):
                m.unload(victim)
        elif op < 0.14:
            warm = rng.choice(adapters)
            for m in (cached, full):
                m.prefetch(warm)
                m.on_request_finished(warm, 1, 1)
        elif op < 0.18:
            name = rng.choice(names)
            for m in (cached, full):
                m.load(name)  # the admin warm-up: may evict an idle slot's adapter
        else:
            if rng.random() < 0.4:  # otherwise the same batch again, as in a steady decode
                step_adapters = rng.sample(adapters, rng.randint(1, 3))
                batch = [rng.choice([None, *step_adapters]) for _ in range(rng.randint(1, 7))]
            before = cached._slotted
            full._placed = full._slotted = None
            slots = []
            for m in (cached, full):
                m.place(list(batch))
                slots.append(m.step_slots(list(batch)))
            expected = [-1 if a is None else cached.pool.slot_of(a) for a in batch]
            assert slots[0] == slots[1] == (expected if any(a is not None for a in batch) else None)
            if before is not None and slots[0] is before[2]:
                reused += 1
        assert _state(cached) == _state(full)
    assert reused > 50  # the reuse path ran, and agreed each time
