"""TenantAuth against a stand-in key lookup: a key revoked through this replica (``forget_all``)
stops working at once, even when a request's lookup read the key just before the revoke and
finishes just after it."""

from __future__ import annotations

import asyncio
import threading

import pytest
from starlette.requests import Request

from loraplex.server.auth import TenantAuth
from loraplex.server.errors import APIError


class SlowKeys:
    """``authenticate`` over a set of live keys; the first call reads, then waits to be let go."""

    def __init__(self):
        self.live = {"secret-1": "acme"}
        self.calls = 0
        self.read = threading.Event()
        self.release = threading.Event()

    def authenticate(self, secret: str):
        self.calls += 1
        tenant = self.live.get(secret)
        if self.calls == 1:
            self.read.set()
            assert self.release.wait(5)
        return tenant


def _request(secret: str) -> Request:
    return Request({"type": "http", "headers": [(b"authorization", f"Bearer {secret}".encode())]})


def test_a_lookup_that_read_a_revoked_key_is_not_cached_past_forget_all():
    keys = SlowKeys()
    auth = TenantAuth(keys.authenticate, cache_seconds=3600)

    async def scenario():
        in_flight = asyncio.ensure_future(auth.tenant_for(_request("secret-1")))
        assert await asyncio.to_thread(keys.read.wait, 5)
        del keys.live["secret-1"]  # the revoke commits ...
        auth.forget_all()  # ... and the admin route forgets the cached keys here
        keys.release.set()
        assert await in_flight == "acme"  # that request keeps what it read
        with pytest.raises(APIError) as err:
            await auth.tenant_for(_request("secret-1"))
        return err.value.status

    assert asyncio.run(scenario()) == 401
    assert keys.calls == 2
