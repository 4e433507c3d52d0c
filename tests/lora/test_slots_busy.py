"""An admin load that cannot be served now because every device slot (or the host budget) is held by
running requests is a transient refusal: 409 with Retry-After, and nothing changed, not a 400
``invalid_adapter`` that tells the operator the adapter or the request is wrong. Found by
tests/e2e/test_chaos_e2e.py (a pin under load was answered 400 "...; try again later")."""

from __future__ import annotations

import pytest

from loraplex.lora.errors import AdapterBusyError, InvalidAdapterError
from loraplex.server.errors import from_exception
from tests.lora.test_manager import new_manager, same, snapshot


def test_device_slots_all_in_the_running_step(lora_base, make_adapter):
    m = new_manager(lora_base.spec)  # two slots
    a, b, c = (m.register(n, make_adapter(n, seed=i)) for i, n in enumerate("abc"))
    m.prepare_step([a, b])  # both slots used by the step that runs
    before = snapshot(m)
    with pytest.raises(AdapterBusyError) as info:
        m.load("c", tier="device", pin=True)
    assert isinstance(info.value, InvalidAdapterError)  # offline callers catching it still do
    assert same(snapshot(m), before)
    err = from_exception(info.value)
    assert (err.status, err.param, err.code, err.headers.get("Retry-After")) == (409, "tier", "adapter_busy", "1")
    assert err.type == "invalid_request_error" and "try again" in err.message
    m.prepare_step([a])  # the step moved on: b's slot can be taken
    assert m.load("c", tier="device", pin=True) == c and m.tier_of(c) == "device"


def test_host_budget_all_in_use(lora_base, make_adapter):
    m = new_manager(lora_base.spec, max_loras=1)
    a = m.register("a", make_adapter("a", seed=1))
    m.prepare_step([a])
    m.host.pinned.add(a)  # nothing in host memory may go ...
    m.host.budget_bytes = m.host.used_bytes  # ... and there is no room left
    c = m.register("c", make_adapter("c", seed=5))
    before = (m.host.ids(), m.host.used_bytes, list(m.pool.adapter_in))
    with pytest.raises(AdapterBusyError) as info:
        m.load("c", tier="host")
    assert (m.host.ids(), m.host.used_bytes, list(m.pool.adapter_in)) == before and c not in m.host
    assert from_exception(info.value).status == 409


def test_a_wrong_tier_is_still_a_400(lora_base):
    err = from_exception(pytest.raises(InvalidAdapterError, new_manager(lora_base.spec).load, "a", tier="disk").value)
    assert (err.status, err.param) == (400, "tier")
