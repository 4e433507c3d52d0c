"""Each tenant's serving limits as this replica applies them: its own concurrency cap (else the
server's ``max_concurrent_requests_per_tenant``), its scheduling weight and its rate limits
(rate_limits.py), read from the registry and kept for ``cache_seconds`` (``registry_poll_seconds``).

The registry is the one place they are set (admin API, CLI), so a change made through any
replica reaches every replica within ``cache_seconds``; one made through this replica's admin
API is applied here at once (``forget``). One indexed row read per tenant per interval keeps
the database out of the per-request path, as ``auth.TenantAuth`` does for keys.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

MAX_CACHED_TENANTS = 10_000  # past this the cache starts over, bounding its memory


@dataclass(frozen=True)
class TenantLimits:
    """What admission and the scheduler use for one tenant's requests."""

    max_concurrent_requests: int | None = None  # None: the server's default cap
    scheduling_weight: float = 1.0
    max_requests_per_minute: int | None = None  # None: unlimited
    max_tokens_per_minute: int | None = None  # None: unlimited


DEFAULT_LIMITS = TenantLimits()


class TenantLimitsCache:
    """Maps a tenant name to its ``TenantLimits`` through ``lookup(name) -> TenantInfo | None``
    (``RegistryService.get_tenant``), cached for ``cache_seconds``. A tenant the registry does
    not know (deleted under a cached key) gets the defaults."""

    def __init__(self, lookup: Callable[[str], Any], cache_seconds: float = 1.0):
        self._lookup = lookup
        self.cache_seconds = cache_seconds
        self._cache: dict[str, tuple[TenantLimits, float]] = {}  # name -> (limits, expires)
        # bumped by ``forget``: a lookup begun before it may have read the old row, and caching
        # that late answer would undo the forget for ``cache_seconds``
        self._generation = 0
        self._lock = threading.Lock()

    async def get(self, tenant: str) -> TenantLimits:
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(tenant)
            generation = self._generation
        if hit is not None and hit[1] > now:
            return hit[0]
        info = await run_in_threadpool(self._lookup, tenant)  # off the event loop: a database read
        limits = DEFAULT_LIMITS if info is None else TenantLimits(
            info.max_concurrent_requests, float(info.scheduling_weight),
            info.max_requests_per_minute, info.max_tokens_per_minute)
        with self._lock:
            if generation == self._generation:  # else a forget came meanwhile: this row may be old
                if len(self._cache) >= MAX_CACHED_TENANTS:
                    self._cache.clear()
                self._cache[tenant] = (limits, now + self.cache_seconds)
        return limits

    def forget(self, tenant: str) -> None:
        """Drop one tenant's entry: its next request reads the registry."""
        with self._lock:
            self._cache.pop(tenant, None)
            self._generation += 1
