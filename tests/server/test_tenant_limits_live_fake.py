"""Per-tenant limits applied live: a tenant's own concurrency cap (429 with Retry-After past it,
while another tenant is not held), its scheduling weight reaching the engine with each request,
and a change made after start honoured at once on the replica it was made through and within
``registry_poll_seconds`` on another replica sharing the database."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.server.conftest import ADMIN_KEY, start_server
from tests.server.fakes import FakeEngine

SLOW = {"model": "fake-model", "prompt": "ab", "max_tokens": 40}  # 40 steps of 0.05 s: 2 s in flight
QUICK = {"model": "fake-model", "prompt": "ab", "max_tokens": 1}


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _patch(srv, tenant: str, body: dict) -> None:
    with srv.admin() as c:
        r = c.patch(f"/admin/v1/tenants/{tenant}", json=body)
    assert r.status_code == 200, r.text


async def _concurrent(srv, key: str, n_slow: int) -> tuple[list[httpx.Response], httpx.Response]:
    """``n_slow`` slow requests of one key in flight, then one more of the same key: the slow
    ones' answers and the extra one's."""
    engine = srv.engine
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        before = len(engine.started)
        slow = [asyncio.create_task(c.post("/v1/completions", json=SLOW, headers=_auth(key))) for _ in range(n_slow)]
        for _ in range(400):  # until all run (a fixed sleep races a loaded machine)
            if len(engine.started) - before >= n_slow:
                break
            await asyncio.sleep(0.025)
        extra = await c.post("/v1/completions", json=QUICK, headers=_auth(key))
        return list(await asyncio.gather(*slow)), extra


@pytest.fixture
def srv(tmp_path):
    server = start_server(tmp_path, FakeEngine(step_seconds=0.05), max_concurrent_requests_per_tenant=4)
    yield server
    server.stop()


def test_a_tenants_own_cap_refuses_only_that_tenant_and_a_change_applies_at_once(srv):
    batch, acme = srv.make_tenant("batch"), srv.make_tenant("acme")
    _patch(srv, "batch", {"max_concurrent_requests": 1})  # after start: no restart

    slow, extra = asyncio.run(_concurrent(srv, batch, 1))
    assert [r.status_code for r in slow] == [200]
    assert extra.status_code == 429 and extra.headers["retry-after"]
    assert extra.json()["error"]["code"] == "rate_limit_exceeded" and "limit 1" in extra.json()["error"]["message"]

    slow, extra = asyncio.run(_concurrent(srv, acme, 1))  # the server's default (4) for acme
    assert [r.status_code for r in slow] == [200] and extra.status_code == 200

    _patch(srv, "batch", {"max_concurrent_requests": 2})
    slow, extra = asyncio.run(_concurrent(srv, batch, 1))
    assert extra.status_code == 200  # the raised cap holds two
    slow, extra = asyncio.run(_concurrent(srv, batch, 2))
    assert [r.status_code for r in slow] == [200, 200] and extra.status_code == 429

    _patch(srv, "batch", {"max_concurrent_requests": None})  # the server's default again
    slow, extra = asyncio.run(_concurrent(srv, batch, 3))
    assert [r.status_code for r in slow] == [200] * 3 and extra.status_code == 200
    assert srv.app.state.ctx.limiter.in_flight() == 0


def _weights_of(srv, key: str, path: str, body: dict) -> list[float]:
    engine = srv.engine
    before = set(engine.weights_seen)
    with srv.tenant_client(key) as c:
        r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    return [w for rid, w in engine.weights_seen.items() if rid not in before]


ROUTES = [
    ("/v1/completions", QUICK),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ("/v1/responses", {"model": "fake-model", "input": "hi", "max_output_tokens": 1}),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 1}}),
]


def test_the_scheduling_weight_reaches_the_engine_from_every_route(srv):
    paying, free = srv.make_tenant("paying"), srv.make_tenant("free")
    for path, body in ROUTES:
        assert _weights_of(srv, paying, path, body) == [1.0]
    _patch(srv, "paying", {"scheduling_weight": 2.5})
    for path, body in ROUTES:
        assert _weights_of(srv, paying, path, body) == [2.5], path
        assert _weights_of(srv, free, path, body) == [1.0], path


def test_a_change_through_one_replica_applies_on_another_within_the_poll_interval(tmp_path):
    # two replicas on one database (same home), each caching tenant settings for POLL seconds
    poll = 0.3
    one = start_server(tmp_path, registry_poll_seconds=poll)
    two = start_server(tmp_path, FakeEngine(step_seconds=0.05), registry_poll_seconds=poll)
    try:
        key = one.make_tenant("acme")
        assert _weights_of(two, key, *ROUTES[0]) == [1.0]  # replica two has read (and cached) weight 1
        with httpx.Client(base_url=one.url, headers=_auth(ADMIN_KEY)) as admin:
            r = admin.patch("/admin/v1/tenants/acme", json={"scheduling_weight": 3, "max_concurrent_requests": 1})
        assert r.status_code == 200
        assert _weights_of(one, key, *ROUTES[0]) == [3.0]  # at once on the replica it was made through
        # every entry replica two cached was read before the change, so it is gone within POLL
        time.sleep(poll + 0.05)
        assert _weights_of(two, key, *ROUTES[0]) == [3.0]
        slow, extra = asyncio.run(_concurrent(two, key, 1))
        assert [r.status_code for r in slow] == [200] and extra.status_code == 429  # and its cap of 1
    finally:
        one.stop()
        two.stop()
