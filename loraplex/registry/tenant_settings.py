"""Per-tenant serving limits an operator sets at run time: ``max_concurrent_requests`` (requests
of the tenant in flight at once on one replica; None restores the server's
``max_concurrent_requests_per_tenant``) and ``scheduling_weight`` (the tenant's share of the
engine under the fair scheduling policy; 1 by default, so weight 2 holds about twice the running
sequences of a weight-1 tenant when both have queues), and the OpenAI-style rate limits
``max_requests_per_minute`` and ``max_tokens_per_minute`` (per replica, or shared by all under
``tenant_limits_scope`` "cluster"; None: unlimited, the default), which the server enforces at admission (loraplex/server/rate_limits.py).

Servers read them with the tenant (``RegistryService.get_tenant``) and cache them for
``registry_poll_seconds``, so a change made through any replica applies on every replica within
that time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

from sqlalchemy.orm import Session

from loraplex.registry import repository as repo
from loraplex.registry.errors import InvalidSetting
from loraplex.registry.info import TenantInfo

# bounds: a cap above what one replica could ever hold is a typo, and a weight ratio beyond
# 10^4 would let one tenant starve another in all but name
MAX_CONCURRENT_REQUESTS_LIMIT = 100_000
MIN_SCHEDULING_WEIGHT = 0.01
MAX_SCHEDULING_WEIGHT = 100.0
# a per-minute limit above these is past what one replica serves (and the tokens one must fit
# PostgreSQL's 32-bit INTEGER)
MAX_REQUESTS_PER_MINUTE_LIMIT = 10_000_000
MAX_TOKENS_PER_MINUTE_LIMIT = 1_000_000_000
TENANT_SETTINGS = ("max_concurrent_requests", "scheduling_weight", "max_requests_per_minute", "max_tokens_per_minute")


def check_max_concurrent_requests(value: Any) -> int | None:
    """An integer in [1, MAX_CONCURRENT_REQUESTS_LIMIT], or None (the server's default)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CONCURRENT_REQUESTS_LIMIT:
        raise InvalidSetting(
            f"max_concurrent_requests must be an integer from 1 to {MAX_CONCURRENT_REQUESTS_LIMIT}, "
            f"or null for the server's default; got {value!r}", param="max_concurrent_requests")
    return value


def check_scheduling_weight(value: Any) -> float:
    """A finite number in [MIN_SCHEDULING_WEIGHT, MAX_SCHEDULING_WEIGHT]."""
    # the range is compared first: math.isfinite raises OverflowError on an int no float holds
    # (JSON's 1e400 is inf, but its 10**400 written out is an int)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not MIN_SCHEDULING_WEIGHT <= value <= MAX_SCHEDULING_WEIGHT or not math.isfinite(value):
        raise InvalidSetting(
            f"scheduling_weight must be a number from {MIN_SCHEDULING_WEIGHT:g} to {MAX_SCHEDULING_WEIGHT:g}; "
            f"got {value!r}", param="scheduling_weight")
    return float(value)


def _rate_limit_check(field: str, most: int):
    def check(value: Any) -> int | None:
        """An integer in [1, most], or None (unlimited)."""
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
            raise InvalidSetting(
                f"{field} must be an integer from 1 to {most}, or null for unlimited; got {value!r}", param=field)
        return value
    return check


CHECKS = {
    "max_concurrent_requests": check_max_concurrent_requests,
    "scheduling_weight": check_scheduling_weight,
    "max_requests_per_minute": _rate_limit_check("max_requests_per_minute", MAX_REQUESTS_PER_MINUTE_LIMIT),
    "max_tokens_per_minute": _rate_limit_check("max_tokens_per_minute", MAX_TOKENS_PER_MINUTE_LIMIT),
}


def check_tenant_settings(changes: Mapping[str, Any]) -> dict[str, Any]:
    """The changes, validated: only known fields, at least one, each in range."""
    unknown = sorted(set(changes) - set(TENANT_SETTINGS))
    if unknown:
        raise InvalidSetting(
            f"unknown tenant setting {unknown[0]!r}; the settings are {', '.join(TENANT_SETTINGS)}", param=unknown[0])
    if not changes:
        raise InvalidSetting(f"nothing to change: give one or more of {', '.join(TENANT_SETTINGS)}")
    return {name: CHECKS[name](value) for name, value in changes.items()}


class TenantSettingsMixin:
    """Tenant settings methods of RegistryService."""

    def _transaction(self) -> AbstractContextManager[Session]:  # provided by RegistryService
        raise NotImplementedError

    def _require_tenant(self, session: Session, name: str, *, for_update: bool = False):  # RegistryService's
        raise NotImplementedError

    def update_tenant_settings(self, name: str, changes: Mapping[str, Any], actor: str = "admin") -> TenantInfo:
        """Set some of a tenant's settings (``{"scheduling_weight": 2}``; a None
        ``max_concurrent_requests`` restores the server's default, a None rate limit makes it
        unlimited); audited as ``tenant.update``
        with each given field's old and new value. Raises InvalidSetting (nothing changed) or
        NotFound."""
        values = check_tenant_settings(changes)
        with self._transaction() as session:
            tenant = self._require_tenant(session, name, for_update=True)
            detail = {}
            for field, value in values.items():
                detail[field] = {"from": getattr(tenant, field), "to": value}
                setattr(tenant, field, value)
            session.flush()
            repo.add_audit_event(
                session, actor=actor, action="tenant.update", tenant=name, object_type="tenant", object_name=name,
                detail=detail,
            )
            return TenantInfo.from_row(tenant)
