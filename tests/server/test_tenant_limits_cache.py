"""TenantLimitsCache against a stand-in registry lookup: a change this replica's admin API makes
(``forget``) is applied at once, even when a request's lookup read the old row just before the
change and finishes just after it."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from loraplex.server.tenant_limits import TenantLimits, TenantLimitsCache


class SlowRegistry:
    """``get_tenant`` over a dict; the first call reads its row, then waits to be let go."""

    def __init__(self, weight: float):
        self.weight = weight
        self.calls = 0
        self.read = threading.Event()  # the first lookup has read the row
        self.release = threading.Event()  # ... and may return it

    def get_tenant(self, name: str):
        self.calls += 1
        row = SimpleNamespace(max_concurrent_requests=None, scheduling_weight=self.weight,
                              max_requests_per_minute=None, max_tokens_per_minute=None)
        if self.calls == 1:
            self.read.set()
            assert self.release.wait(5)
        return row


def test_a_lookup_that_read_the_old_row_is_not_cached_past_forget():
    registry = SlowRegistry(weight=1.0)
    cache = TenantLimitsCache(registry.get_tenant, cache_seconds=3600)

    async def scenario():
        in_flight = asyncio.ensure_future(cache.get("acme"))  # a request admitted before the PATCH
        assert await asyncio.to_thread(registry.read.wait, 5)
        registry.weight = 4.0  # the PATCH commits ...
        cache.forget("acme")  # ... and the admin route forgets the tenant here
        registry.release.set()
        old = await in_flight
        return old, await cache.get("acme")

    old, after = asyncio.run(scenario())
    assert old == TenantLimits(None, 1.0)  # that request keeps what it read
    assert after == TenantLimits(None, 4.0)  # the next one sees the change, not the late old row
    assert registry.calls == 2
