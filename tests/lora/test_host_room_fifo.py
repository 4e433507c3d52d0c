"""Adapters waiting for host room are served in arrival order. A large adapter that found the
host cache full of adapters in use waited in ``HostTier.wanted``, but every new request for a small
adapter reserved whatever room freed up first (``_warm`` -> ``HostTier.load``), so under steady
traffic to small adapters the large one never got in: its requests waited for ever."""

from __future__ import annotations

import threading

import pytest

from loraplex.lora.errors import AdapterBusyError
from tests.lora.test_manager import new_manager


def test_a_large_adapter_waiting_for_host_room_is_not_overtaken(lora_base, make_adapter):
    probe = new_manager(lora_base.spec)
    unit = probe.host.get(probe.register("p", make_adapter("p", seed=9, r=2))).nbytes
    m = new_manager(lora_base.spec, max_loras=1, max_cpu_lora_bytes=5 * unit)
    small = [m.register(f"s{i}", make_adapter(f"s{i}", seed=i, r=2)) for i in range(8)]
    big = m.register("big", make_adapter("big", seed=20, r=8))
    for a in [*small, big]:
        m.unload(a)
    woke = threading.Event()
    m.start_background_reads(on_done=woke.set)

    def settle():
        assert m.host_tier.loader.wait(30)
        m.collect_reads()

    m.prefetch(small[0])  # read, then into the free slot: running
    settle()
    for a in small[1:3]:  # queued behind it, in host memory (protected: requests, no slot)
        m.prefetch(a)
    settle()
    m.prefetch(big)  # 4 units: no room now
    settle()
    assert not m.is_ready(big)
    for nxt in range(3, 8):  # steady traffic: the slot's adapter finishes, another small one arrives
        running = m.pool.adapter_in[0]
        m.on_request_finished(running, 1, 1)
        m.prefetch(small[nxt])
        settle()
        m.prepare_step([m.pool.adapter_in[0]])
        settle()
        if m.is_ready(big):
            break
        budget = m.host.used_bytes + m.host.reserved_bytes
        assert budget <= m.host.budget_bytes
    assert m.is_ready(big), "the large adapter was overtaken by every small one"
    m.stop_background_reads()


def test_an_adapter_host_pins_leave_no_room_for_holds_nobody_up(lora_base, make_adapter):
    """First come first served, but not behind an adapter that can never get in: host entries
    an operator pinned leave it too little of the budget. A new request for such an adapter is
    refused (409, transient) rather than left waiting for as long as the pins stay; one queued
    before the pin waits, without holding later ones up."""
    probe = new_manager(lora_base.spec)
    unit = probe.host.get(probe.register("p", make_adapter("p", seed=9, r=2))).nbytes
    m = new_manager(lora_base.spec, max_loras=1, max_cpu_lora_bytes=5 * unit)
    run = m.register("run", make_adapter("run", seed=31, r=2))
    pin = m.register("pin", make_adapter("pin", seed=30, r=4))  # 2 units
    big = m.register("big", make_adapter("big", seed=20, r=8))  # 4 units: never beside a pinned 2
    small = m.register("s", make_adapter("s", seed=1, r=2))
    for a in (run, pin, big, small):
        m.unload(a)
    m.start_background_reads(on_done=lambda: None)

    def settle():
        assert m.host_tier.loader.wait(30)
        m.collect_reads()

    m.prefetch(run)  # takes the one slot and keeps it
    settle()
    m.prefetch(pin)  # waits for the slot in host memory: 2 of 5 units, protected
    settle()
    m.prefetch(run)
    m.prefetch(big)  # 1 + 2 + 4 > 5 with nothing to evict: waits for room
    settle()
    assert not m.is_ready(big) and big in m.host_tier.wanted
    m.host.pinned.add(pin)  # an operator pins it: big can never get in now
    m.prefetch(small)  # not held up behind big
    settle()
    assert m.is_ready(small) and not m.is_ready(big)
    m.on_request_finished(big, 1, 0)
    with pytest.raises(AdapterBusyError, match="pinned"):  # a new request for it is refused
        m.prefetch(big)
    assert m.stats()["adapters"][big]["outstanding_requests"] == 0 and big not in m.host_tier.wanted
    m.stop_background_reads()
