"""ExpiringCache, the registry-answer cache under TenantAuth and TenantLimitsCache: entries
expire after their TTL, unknown keys (None) are read again each time, the size stays bounded,
and forget / forget_all take effect at once."""

from __future__ import annotations

import asyncio

import pytest

from loraplex.server import expiring_cache
from loraplex.server.expiring_cache import ExpiringCache


class CountingLookup:
    """A stand-in registry read: answers ``table[key]`` and counts the reads."""

    def __init__(self, table: dict):
        self.table = table
        self.reads: list[str] = []

    def loader(self, key: str):
        def load():
            self.reads.append(key)
            return self.table.get(key)
        return load


def _get(cache: ExpiringCache, lookup: CountingLookup, key: str):
    return asyncio.run(cache.get_or_load(key, lookup.loader(key)))


def test_an_entry_is_read_once_per_ttl(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(expiring_cache.time, "monotonic", lambda: clock[0])
    lookup = CountingLookup({"a": "acme"})
    cache = ExpiringCache(ttl_seconds=5.0)
    assert [_get(cache, lookup, "a") for _ in range(3)] == ["acme"] * 3
    assert lookup.reads == ["a"]
    clock[0] += 4.9
    assert _get(cache, lookup, "a") == "acme" and lookup.reads == ["a"]
    lookup.table["a"] = "other"  # changed by another replica: seen once the entry expires
    clock[0] += 0.2
    assert _get(cache, lookup, "a") == "other"
    assert lookup.reads == ["a", "a"]


def test_none_is_never_cached():
    lookup = CountingLookup({})
    cache = ExpiringCache(ttl_seconds=3600)
    assert _get(cache, lookup, "missing") is None
    lookup.table["missing"] = "created since"
    assert _get(cache, lookup, "missing") == "created since"
    assert len(cache) == 1


def test_forget_and_forget_all_drop_entries_at_once():
    lookup = CountingLookup({"a": 1, "b": 2})
    cache = ExpiringCache(ttl_seconds=3600)
    _get(cache, lookup, "a"), _get(cache, lookup, "b")
    lookup.table.update(a=10, b=20)
    cache.forget("a")
    assert (_get(cache, lookup, "a"), _get(cache, lookup, "b")) == (10, 2)
    cache.forget_all()
    assert (_get(cache, lookup, "a"), _get(cache, lookup, "b")) == (10, 20)
    assert lookup.reads == ["a", "b", "a", "a", "b"]


@pytest.mark.parametrize("max_entries", [1, 3])
def test_the_size_stays_bounded(max_entries):
    lookup = CountingLookup({str(i): i for i in range(10)})
    cache = ExpiringCache(ttl_seconds=3600, max_entries=max_entries)
    for i in range(10):
        assert _get(cache, lookup, str(i)) == i
        assert len(cache) <= max_entries
