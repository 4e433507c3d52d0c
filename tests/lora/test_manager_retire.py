"""LoRAManager.retire (weights whose versions were all deleted): unloaded at once, and their record
and stats dropped now or as soon as the last request, name or read holding them lets go; the
counters of a dropped record stay in the totals (``forgotten``) so they never go back."""

from __future__ import annotations

from loraplex.lora.spec import AdapterRef
from tests.lora.test_manager import new_manager

COUNTERS = ("loads", "evictions", "host_loads", "host_evictions", "requests", "prompt_tokens", "generation_tokens")


def _totals(stats: dict) -> dict:
    """Each counter summed over every record and the forgotten ones."""
    entries = list(stats["adapters"].values()) + [stats["forgotten"]]
    return {k: sum(e[k] for e in entries) for k in COUNTERS}


def test_retire_waits_for_the_last_request(lora_base, make_adapter):
    m = new_manager(lora_base.spec)
    other = m.resolve(AdapterRef(name="o", path=str(make_adapter("o", seed=2))))
    a = m.resolve(AdapterRef(name="gone@1", path=str(make_adapter("gone", seed=1))))
    m.prefetch(a)
    m.prefetch(a)  # two requests queued
    assert m.tier_of(a) == "device"
    assert not m.retire(a)
    assert a in m.stats()["adapters"] and m.pool.slot_of(a) is None  # out of its slot, record kept
    m.on_request_finished(a, 3, 4)
    assert m.stats()["adapters"][a]["outstanding_requests"] == 1  # one request still holds it
    before = _totals(m.stats())
    m.on_request_finished(a, 5, 6)
    stats = m.stats()
    assert a not in stats["adapters"] and a not in m.catalog.records and m.tier_of(a) == "disk"
    assert other in stats["adapters"]  # another adapter is untouched
    after = _totals(stats)
    # the dropped record's counters stay in the totals, its last request counted
    assert after == {**before, "requests": before["requests"] + 1, "prompt_tokens": before["prompt_tokens"] + 5,
                     "generation_tokens": before["generation_tokens"] + 6}


def test_retire_of_an_unheld_adapter_is_at_once_and_drops_pins(lora_base, make_adapter):
    m = new_manager(lora_base.spec)
    ref = AdapterRef(name="p@1", path=str(make_adapter("p", seed=1)))
    a = m.load(ref, tier="device", pin=True)
    assert m.stats()["slots"]["pinned"] == 1
    assert m.retire(a)
    stats = m.stats()
    assert a not in stats["adapters"] and stats["slots"]["pinned"] == 0 and stats["tiers"] == {"device": 0, "host": 0}
    assert m.retire(a)  # unknown: nothing to do
    # loaded again (re-uploaded): read as new, counted afresh
    assert m.resolve(ref) == a and m.stats()["adapters"][a]["host_loads"] == 1


def test_a_name_holds_a_retired_adapter_until_unregistered(lora_base, make_adapter):
    m = new_manager(lora_base.spec)
    path = make_adapter("n", seed=1)
    a = m.register("n", path)
    assert not m.retire(a) and a in m.stats()["adapters"]
    m.unregister("n")
    assert a not in m.stats()["adapters"]


def test_resolved_again_before_it_is_let_go_it_stays(lora_base, make_adapter):
    """The same weights uploaded anew while a request still runs the deleted version: the
    record serves the new version and is not dropped when the old request ends."""
    m = new_manager(lora_base.spec)
    ref = AdapterRef(name="s@1", path=str(make_adapter("s", seed=1)))
    a = m.resolve(ref)
    m.prefetch(a)
    assert not m.retire(a)
    assert m.resolve(AdapterRef(name="s@2", path=ref.path)) == a
    m.on_request_finished(a, 1, 1)
    assert a in m.stats()["adapters"]
