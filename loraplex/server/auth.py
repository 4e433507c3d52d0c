"""Bearer-key authentication for tenant and admin routes.

Tenant keys are checked by the registry (only their sha256 is stored there). A short-lived cache,
keyed by the key's sha256 (never the key itself), spares the database one query per request; a
revoke made through this process clears it at once, one made through another replica is seen
within ``cache_seconds``. The admin key is ``Settings.admin_key`` when set, else the hash the
registry holds.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from loraplex.server.errors import APIError, unauthorized
from loraplex.server.expiring_cache import ExpiringCache


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


class TenantAuth:
    """Maps a bearer key to its tenant through ``authenticate(secret) -> tenant | None``."""

    def __init__(self, authenticate: Callable[[str], str | None], cache_seconds: float = 1.0):
        self._authenticate = authenticate
        self._tenants: ExpiringCache[str] = ExpiringCache(cache_seconds)  # keyed by sha256(key)

    async def tenant_for(self, request: Request, path_tenant: str | None = None) -> str:
        """The tenant the request's key belongs to; 401 when the key is missing, unknown,
        revoked, or belongs to a tenant other than ``path_tenant``."""
        secret = bearer_token(request)
        if secret is None:
            raise unauthorized("Missing API key: send `Authorization: Bearer <key>`.")
        tenant = await self._tenants.get_or_load(_digest(secret), lambda: self._authenticate(secret))
        if tenant is None:
            raise unauthorized()
        if path_tenant is not None and tenant != path_tenant:
            raise unauthorized("This API key is not valid for this tenant.")
        return tenant

    def forget_all(self) -> None:
        """After a key is revoked through this replica: every key is looked up again (a lookup
        already under way when the key was revoked is not cached)."""
        self._tenants.forget_all()


class AdminAuth:
    """Checks the admin bearer key: against ``admin_key`` when configured, else through
    ``check_stored(secret) -> bool`` (the hash kept in the registry)."""

    def __init__(self, admin_key: str | None, check_stored: Callable[[str], bool] | None):
        self._admin_digest = _digest(admin_key) if admin_key else None
        self._check_stored = check_stored

    async def require(self, request: Request) -> None:
        secret = bearer_token(request)
        if secret is None:
            raise unauthorized("Missing admin key: send `Authorization: Bearer <admin key>`.")
        if self._admin_digest is not None:
            ok = hmac.compare_digest(_digest(secret), self._admin_digest)
        elif self._check_stored is not None:
            ok = bool(await run_in_threadpool(self._check_stored, secret))
        else:
            ok = False
        if not ok:
            raise APIError(401, "Invalid admin key.", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
