"""Each tenant's serving limits as this replica applies them: its own concurrency cap (else the
server's ``max_concurrent_requests_per_tenant``), its scheduling weight and its rate limits
(rate_limits.py), read from the registry and kept for ``cache_seconds`` (``registry_poll_seconds``).
Under ``tenant_limits_scope`` "cluster" the live replicas divide the cap (``concurrency_cap``)
and the rate limits among themselves (cluster_presence.py).

The registry is the one place they are set (admin API, CLI), so a change made through any
replica reaches every replica within ``cache_seconds``; one made through this replica's admin
API is applied here at once (``forget``). One indexed row read per tenant per interval keeps
the database out of the per-request path, as ``auth.TenantAuth`` does for keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loraplex.server.expiring_cache import ExpiringCache


@dataclass(frozen=True)
class TenantLimits:
    """What admission and the scheduler use for one tenant's requests."""

    max_concurrent_requests: int | None = None  # None: the server's default cap
    scheduling_weight: float = 1.0
    max_requests_per_minute: int | None = None  # None: unlimited
    max_tokens_per_minute: int | None = None  # None: unlimited

    def concurrency_cap(self, replicas: int = 1) -> int | None:
        """This replica's part of the tenant's own cap when ``replicas`` share it: rounded down,
        so the replicas together never hold more than the cap (unless there are more replicas
        than the cap: each keeps 1, or the tenant could not run at all). None: the server's
        ``max_concurrent_requests_per_tenant``, a per-replica setting, applies whole."""
        if self.max_concurrent_requests is None:
            return None
        return max(1, self.max_concurrent_requests // max(1, replicas))


DEFAULT_LIMITS = TenantLimits()


class TenantLimitsCache:
    """Maps a tenant name to its ``TenantLimits`` through ``lookup(name) -> TenantInfo | None``
    (``RegistryService.get_tenant``), cached for ``cache_seconds``. A tenant the registry does
    not know (deleted under a cached key) gets the defaults."""

    def __init__(self, lookup: Callable[[str], Any], cache_seconds: float = 1.0):
        self._lookup = lookup
        self._limits: ExpiringCache[TenantLimits] = ExpiringCache(cache_seconds)

    async def get(self, tenant: str) -> TenantLimits:
        return await self._limits.get_or_load(tenant, lambda: _limits_of(self._lookup(tenant)))

    def forget(self, tenant: str) -> None:
        """Drop one tenant's entry: its next request reads the registry (a read already under
        way is not cached, as it may have seen the old row)."""
        self._limits.forget(tenant)


def _limits_of(info) -> TenantLimits:
    if info is None:
        return DEFAULT_LIMITS
    return TenantLimits(info.max_concurrent_requests, float(info.scheduling_weight),
                        info.max_requests_per_minute, info.max_tokens_per_minute)
