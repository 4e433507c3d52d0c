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
import threading
import time
from collections.abc import Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from loraplex.server.errors import APIError, unauthorized


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
        self.cache_seconds = cache_seconds
        self._cache: dict[str, tuple[str, float]] = {}  # sha256(key) -> (tenant, expires)
        self._lock = threading.Lock()
        # bumped by ``forget_all``: a lookup begun before it may have read a key since revoked,
        # and caching that late answer would let the key in for ``cache_seconds`` more
        self._generation = 0

    async def tenant_for(self, request: Request, path_tenant: str | None = None) -> str:
        """The tenant the request's key belongs to; 401 when the key is missing, unknown,
        revoked, or belongs to a tenant other than ``path_tenant``."""
        secret = bearer_token(request)
        if secret is None:
            raise unauthorized("Missing API key: send `Authorization: Bearer <key>`.")
        digest = _digest(secret)
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(digest)
            generation = self._generation
        if hit is not None and hit[1] > now:
            tenant = hit[0]
        else:
            tenant = await run_in_threadpool(self._authenticate, secret)
            if tenant is None:
                raise unauthorized()
            with self._lock:
                if len(self._cache) > 10_000:
                    self._cache.clear()
                if generation == self._generation:  # else a revoke came meanwhile: not cached
                    self._cache[digest] = (tenant, now + self.cache_seconds)
        if path_tenant is not None and tenant != path_tenant:
            raise unauthorized("This API key is not valid for this tenant.")
        return tenant

    def forget_all(self) -> None:
        """After a key is revoked through this replica: every key is looked up again."""
        with self._lock:
            self._cache.clear()
            self._generation += 1


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
