"""LoRAManager: rejections leave every pool and cache as they were, re-registration serves new
weights at once, prefetch loads ahead of the step, LRU + pins + reference counts, host budget."""

from __future__ import annotations

import pytest
import torch

from loraplex.config import EngineConfig
from loraplex.lora.errors import AdapterHashMismatchError, AdapterNotFoundError, InvalidAdapterError
from loraplex.lora.manager import LoRAManager
from loraplex.lora.spec import AdapterRef
from tests.fixtures.peft_adapters import peft_model_for
from tests.lora.adapter_edits import BAD_ADAPTERS
from tests.lora.test_context import peft_delta


def new_manager(spec, **options) -> LoRAManager:
    return LoRAManager(spec, EngineConfig(**{"max_loras": 2, "max_lora_rank": 8, **options}), "cpu", torch.float32)


def snapshot(m: LoRAManager) -> dict:
    stacks = [(st.a.clone(), st.b.clone(), st.scaling.clone()) for layer in m.pool.stacks for st in layer.values()]
    return {
        "registered": m.registered(),
        "host": m.host.ids(),
        "host_bytes": m.host.used_bytes,
        "slots": list(m.pool.adapter_in),
        "ranks": m.pool.slot_rank.tolist(),
        "stats": m.stats(),
        "stacks": stacks,
    }


def same(a: dict, b: dict) -> bool:
    tensors_equal = all(
        torch.equal(x, y) for sa, sb in zip(a["stacks"], b["stacks"]) for x, y in zip(sa, sb)
    )
    return tensors_equal and {k: v for k, v in a.items() if k != "stacks"} == {k: v for k, v in b.items() if k != "stacks"}


@pytest.mark.parametrize("kind", sorted(BAD_ADAPTERS))
def test_rejection_loads_nothing(kind, lora_base, make_adapter, tmp_path):
    torch.manual_seed(0)
    good = make_adapter("good", seed=1)
    other = make_adapter("other", seed=2)
    m = new_manager(lora_base.spec)
    good_id = m.register("good", good)
    m.register("other", other)
    m.prepare_step([good_id, None])  # good in a device slot, other in host
    before = snapshot(m)

    make, match = BAD_ADAPTERS[kind]
    bad = make(good, tmp_path / f"bad_{kind}")
    for attempt in (
        lambda: m.register("good", bad),  # re-pointing an existing name
        lambda: m.register("fresh", bad),
        lambda: m.resolve(str(bad)),
        lambda: m.load(str(bad), tier="device", pin=True),
    ):
        with pytest.raises(InvalidAdapterError, match=match):
            attempt()
        assert same(before, snapshot(m)), kind
    assert m.resolve("good") == good_id


def test_hash_mismatch_loads_nothing(lora_base, make_adapter):
    m = new_manager(lora_base.spec)
    d = make_adapter("a", seed=1)
    before = snapshot(m)
    with pytest.raises(AdapterHashMismatchError):
        m.resolve(AdapterRef(name="a", path=str(d), content_hash="0" * 64))
    assert same(before, snapshot(m))
    good = m.resolve(AdapterRef(name="a", path=str(d)))
    assert m.resolve(AdapterRef(name="a", path=str(d), content_hash=good)) == good


def test_weights_out_of_range_of_the_serving_dtype_load_nothing(lora_base, make_adapter, tmp_path):
    """Finite in the file but infinite in float16 (|x| > 65504) is refused like an Inf weight."""
    from tests.lora.adapter_edits import edit_tensors

    def big(t):
        k = sorted(k for k in t if "lora_B" in k)[0]
        t[k] = t[k].clone()
        t[k][0, 0] = 1e6
        # with A that small the update stays within the check every dtype makes (peft_format)
        a = k.replace("lora_B", "lora_A")
        t[a] = t[a] * 1e-4

    src = make_adapter("fp16", seed=1)
    bad = edit_tensors(src, tmp_path / "big", big)
    m = LoRAManager(lora_base.spec, EngineConfig(max_loras=2, max_lora_rank=8), "cpu", torch.float16)
    good_id = m.register("good", src)
    before = snapshot(m)
    with pytest.raises(InvalidAdapterError, match="float16"):
        m.register("big", bad)
    assert same(before, snapshot(m)) and m.resolve("good") == good_id
    # float32 holds it: the same file loads there
    assert new_manager(lora_base.spec).register("big", bad)


def test_unknown_name(lora_base):
    with pytest.raises(AdapterNotFoundError):
        new_manager(lora_base.spec).resolve("no-such-adapter")


def _lora_out(m: LoRAManager, adapter_id: str, x: torch.Tensor) -> torch.Tensor:
    ctx = m.prepare_step([adapter_id] * x.shape[0])
    y = torch.zeros(x.shape[0], 64 + 32 + 32)
    ctx.apply(1, "qkv_proj", x, y)
    return y


def test_reregister_serves_new_weights_at_once(lora_base, make_adapter):
    torch.manual_seed(0)
    d1 = make_adapter("v1", seed=1, target_modules=["q_proj", "k_proj", "v_proj"])
    d2 = make_adapter("v2", seed=2, target_modules=["q_proj", "k_proj", "v_proj"])
    peft = peft_model_for(lora_base.model, {"v1": d1, "v2": d2})
    m = new_manager(lora_base.spec)
    x = torch.randn(3, 64)
    id1 = m.register("x", d1)
    with torch.no_grad():
        torch.testing.assert_close(_lora_out(m, m.resolve("x"), x), peft_delta(peft, "v1", 1, "qkv_proj", x))
        assert m.tier_of(id1) == "device"
        id2 = m.register("x", d2)
        assert id2 != id1 and m.resolve("x") == id2
        torch.testing.assert_close(_lora_out(m, m.resolve("x"), x), peft_delta(peft, "v2", 1, "qkv_proj", x))


def test_prefetch_loads_before_the_step(lora_base, make_adapter):
    m = new_manager(lora_base.spec)
    a = m.register("a", make_adapter("a", seed=1))
    assert m.tier_of(a) == "host" and m.is_ready(a)
    m.prefetch(a)
    assert m.tier_of(a) == "device" and m.stats()["adapters"][a]["loads"] == 1
    m.prepare_step([a, a, None])
    assert m.stats()["adapters"][a]["loads"] == 1  # the step found it already loaded


def test_lru_pins_and_refs(lora_base, make_adapter):
    m = new_manager(lora_base.spec, max_loras=3)
    ids = {n: m.register(n, make_adapter(n, seed=i)) for i, n in enumerate("pabcd")}
    m.load("p", tier="device", pin=True)
    assert m.num_reserved_slots(set()) == 1 and m.num_reserved_slots({ids["p"]}) == 0
    m.prepare_step([ids["a"]])
    m.prepare_step([ids["b"]])
    m.prepare_step([ids["c"]])  # evicts a (LRU), never the pinned p
    assert m.tier_of(ids["p"]) == "device" and m.tier_of(ids["a"]) != "device"
    assert m.tier_of(ids["b"]) == "device" and m.stats()["adapters"][ids["a"]]["evictions"] == 1
    # b has a request in flight, c has none: d evicts c although b is older
    m.prefetch(ids["b"])
    m.prepare_step([ids["d"]])
    assert m.tier_of(ids["b"]) == "device" and m.tier_of(ids["c"]) != "device"
    # a step's own adapters are never evicted; too many for the free slots is a scheduler bug
    with pytest.raises(RuntimeError):
        m.prepare_step([ids["a"], ids["c"], ids["d"]])
    with pytest.raises(InvalidAdapterError, match="pinned"):
        m.load("a", tier="device", pin=True) and m.load("b", tier="device", pin=True)


def test_host_budget_lru_and_waiting_adapters(lora_base, make_adapter):
    probe = new_manager(lora_base.spec)
    size = probe.host.get(probe.register("probe", make_adapter("probe", seed=9))).nbytes
    m = new_manager(lora_base.spec, max_loras=1, max_cpu_lora_bytes=size)  # room for one adapter
    a, b, c = (m.register(n, make_adapter(n, seed=i)) for i, n in enumerate("abc"))
    st = m.stats()["adapters"]
    assert m.host.ids() == [c] and st[a]["host_evictions"] == 1 and st[b]["host_evictions"] == 1
    assert not m.is_ready(a)
    m.prefetch(a)  # free slot: straight from disk to the device
    assert m.tier_of(a) == "device" and m.is_ready(a)
    m.prefetch(b)  # no idle slot: b goes to host, evicting c (no requests)
    assert m.host.ids() == [b] and m.tier_of(c) == "disk"
    m.prefetch(c)  # host holds b, which waits for a slot: c must wait too
    assert not m.is_ready(c)
    m.on_request_finished(a, 5, 3)  # a is idle now: b takes its slot at once, ahead of any step
    assert m.tier_of(b) == "device" and m.stats()["adapters"][b]["loads"] == 1
    m.prepare_step([b])  # b's host copy is no longer needed, so c comes in
    assert m.stats()["adapters"][b]["loads"] == 1 and m.is_ready(c)
    st = m.stats()["adapters"]
    assert st[a]["requests"] == 1 and st[a]["prompt_tokens"] == 5 and st[a]["generation_tokens"] == 3


def test_unregister_and_unload(lora_base, make_adapter):
    m = new_manager(lora_base.spec)
    a = m.register("a", make_adapter("a", seed=1))
    m.prefetch(a)
    m.unload(a)
    # a queued request still runs: reloaded from its directory into host memory at once, since
    # the scheduler admits it only once its adapter is ready (test_unload_queued.py)
    assert m.tier_of(a) == "host" and m.is_ready(a)
    m.prepare_step([a])
    assert m.tier_of(a) == "device"
    m.on_request_finished(a, 1, 1)
    m.unload(a)  # nothing uses it: gone from device and host
    assert m.tier_of(a) == "disk"
    m.unregister("a")
    assert "a" not in m.registered() and m.tier_of(a) == "disk"
    with pytest.raises(AdapterNotFoundError):
        m.unregister("a")


def test_read_ahead_reads_without_state_then_resolve_uses_it(lora_base, make_adapter, monkeypatch):
    """read_ahead does the file work (for another thread) and changes nothing; resolve then
    takes its result instead of reading again; stale or unneeded reads are handled."""
    m = new_manager(lora_base.spec)
    known = m.register("known", make_adapter("known", seed=1))
    fresh = make_adapter("fresh", seed=2)
    before = snapshot(m)
    prepared = m.read_ahead(str(fresh))
    assert prepared is not None and same(snapshot(m), before)
    assert m.read_ahead("known") is None and m.read_ahead(None) is None
    assert m.read_ahead(AdapterRef("k", str(m._records[known].path), known)) is None

    def no_read(*args, **kwargs):
        raise AssertionError("resolve read the files again")

    with monkeypatch.context() as patch:
        patch.setattr(m.catalog, "read", no_read)
        adapter_id = m.resolve(str(fresh), prepared)
    assert adapter_id == prepared.weights.adapter_id and m.read_ahead(str(fresh)) is None

    # files rewritten after the read-ahead: resolve reads them again, never serves the old ones
    other = make_adapter("other", seed=3)
    stale = m.read_ahead(str(other))
    newer = make_adapter("other", seed=4)  # same directory, new weights
    assert newer == other
    assert m.resolve(str(other), stale) != stale.weights.adapter_id


def test_read_ahead_rejects_bad_adapter_before_the_engine_sees_it(lora_base, make_adapter, tmp_path):
    m = new_manager(lora_base.spec)
    good = make_adapter("good", seed=1)
    m.register("good", good)
    before = snapshot(m)
    make, match = BAD_ADAPTERS["nan"]
    bad = make(good, tmp_path / "bad")
    with pytest.raises(InvalidAdapterError, match=match):
        m.read_ahead(str(bad))
    with pytest.raises(AdapterHashMismatchError):  # the registry's hash and the files disagree
        m.read_ahead(AdapterRef("new", str(make_adapter("new", seed=2)), "0" * 64))
    assert same(snapshot(m), before)


def test_forget_drops_an_unheld_adapter_everywhere(lora_base, make_adapter):
    """``forget`` (a merge nobody will name again): refused while a request, a name or a pin holds
    the adapter; otherwise gone from slots, host memory, the catalog and the stats, and the same
    files given again are read as new. Another adapter is untouched."""
    m = new_manager(lora_base.spec)
    kept = m.resolve(AdapterRef(name="k", path=str(make_adapter("k", seed=2))))
    path = make_adapter("m", seed=1)
    ref = AdapterRef(name="+merged", path=str(path))
    a = m.resolve(ref)
    m.prefetch(a)
    assert m.tier_of(a) == "device"
    assert not m.forget(a) and a in m.stats()["adapters"]  # a request is queued
    m.on_request_finished(a, 1, 1)
    m.load(ref, tier="device", pin=True)
    assert not m.forget(a) and m.tier_of(a) == "device"  # pinned
    m.unload(a)
    registered = m.register("name", path)
    assert registered == a and not m.forget(a)  # named
    m.unregister("name")
    m.resolve(ref)
    assert m.forget(a)
    assert a not in m.stats()["adapters"] and a not in m.catalog.records and m.tier_of(a) == "disk"
    assert a not in m.host.ids() and m.pool.slot_of(a) is None
    assert kept in m.stats()["adapters"]
    assert m.forget(a)  # unknown: nothing to do
    assert m.resolve(ref) == a and m.stats()["adapters"][a]["host_loads"] == 1  # read again, as new
