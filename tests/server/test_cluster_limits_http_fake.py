"""Tenant limits across two replicas over HTTP: two servers (fake engines) on one registry
database, SQLite file or PostgreSQL, as two pods behind a balancer. Under
``--tenant-limits-scope cluster`` a tenant at N requests a minute gets N through both together,
the rest 429 with ``Retry-After`` in OpenAI's error shape; under ``replica`` (the default) each
server admits N, as before; a replica that leaves, or goes silent, gives its share back to the
other. The limiters' clocks are frozen (and moved by hand), so nothing refills while a test runs;
the heartbeats run on real time."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.conftest import start_server
from tests.server.fakes import GatedEngine

# the heartbeat interval; a silent replica expires after three. At 0.2 s a heartbeat 0.6 s late
# was enough for a live replica to drop out of the count mid-test on a loaded CI machine (the
# info test saw its share grow from 2 to 4 and a request it expected refused was admitted,
# 2026-12-04); at 0.5 s that takes a 1.5 s stall.
POLL_SECONDS = 0.5
BODY = {"model": "fake-model", "prompt": "ab", "max_tokens": 1}


@pytest.fixture
def two_replicas(tmp_path, registry_url):
    """``make(**settings)`` -> two servers on one registry, their limiter clocks frozen at one
    shared, movable time (``clock[0]``)."""
    started, clock = [], [1000.0]

    def make(**settings):
        for name in ("a", "b"):
            srv = start_server(tmp_path / name, GatedEngine(), database_url=registry_url,
                               registry_poll_seconds=POLL_SECONDS, **settings)
            srv.app.state.ctx.rate_limiter.clock = lambda: clock[0]
            started.append(srv)
        return started[0], started[1], clock

    yield make
    for srv in started:
        srv.stop()


def _wait_for(condition, seconds: float) -> float:
    """Seconds until ``condition()`` held; fails after ``seconds``."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < seconds, "condition not reached in time"
        time.sleep(0.02)
    return time.monotonic() - start


def _tenant(srv, name: str, **limits) -> str:
    key = srv.make_tenant(name)
    srv.registry.update_tenant_settings(name, limits)
    return key


def _post_alternating(servers, key: str, count: int) -> list:
    clients = [srv.tenant_client(key) for srv in servers]
    try:
        return [clients[i % len(clients)].post("/v1/completions", json=BODY) for i in range(count)]
    finally:
        for c in clients:
            c.close()


def _limit_replicas_metric(srv) -> float:
    text = httpx.get(srv.url + "/metrics").text
    values = [line.split()[1] for line in text.splitlines() if line.startswith("loraplex_tenant_limit_replicas ")]
    assert len(values) == 1, text
    return float(values[0])


def _assert_openai_rate_limited(answer) -> None:
    assert answer.status_code == 429, answer.text
    assert int(answer.headers["retry-after"]) >= 1
    error = answer.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"


def test_cluster_scope_admits_the_limit_across_both_replicas(two_replicas):
    a, b, _ = two_replicas(tenant_limits_scope="cluster")
    _wait_for(lambda: a.app.state.ctx.live_replicas == b.app.state.ctx.live_replicas == 2, 5)
    n = 6
    key = _tenant(a, "acme", max_requests_per_minute=n)
    answers = _post_alternating([a, b], key, 2 * n + 2)
    assert sum(r.status_code == 200 for r in answers) == n
    for refused in (r for r in answers if r.status_code != 200):
        _assert_openai_rate_limited(refused)
        assert refused.headers["x-ratelimit-limit-requests"] == str(n)  # the tenant's limit, not a share
    # the database records both replicas, and each says on /metrics how many it counts
    assert len(a.registry.replicas_seen(60)) == 2
    for srv in (a, b):
        assert _limit_replicas_metric(srv) == 2.0


def test_cluster_scope_holds_for_all_traffic_sent_to_one_replica(two_replicas):
    # uneven balancing: one replica admits only its share, so the deployment admits less
    # than the limit, never more
    a, b, _ = two_replicas(tenant_limits_scope="cluster")
    _wait_for(lambda: a.app.state.ctx.live_replicas == 2, 5)
    key = _tenant(a, "acme", max_requests_per_minute=6)
    answers = _post_alternating([a], key, 8)
    assert [r.status_code for r in answers] == [200] * 3 + [429] * 5


def test_replica_scope_lets_each_replica_admit_the_whole_limit(two_replicas):
    a, b, _ = two_replicas()  # the default scope
    n = 6
    key = _tenant(a, "acme", max_requests_per_minute=n)
    answers = _post_alternating([a, b], key, 2 * n + 2)
    assert [r.status_code for r in answers] == [200] * (2 * n) + [429] * 2
    assert a.app.state.ctx.presence is None and b.app.state.ctx.presence is None
    assert a.registry.replicas_seen(60) == []  # no heartbeats written
    assert _limit_replicas_metric(a) == _limit_replicas_metric(b) == 1.0


def test_a_replica_leaving_gives_its_share_back(two_replicas):
    a, b, clock = two_replicas(tenant_limits_scope="cluster")
    _wait_for(lambda: a.app.state.ctx.live_replicas == 2, 5)
    n = 6
    key = _tenant(a, "acme", max_requests_per_minute=n)
    assert [r.status_code for r in _post_alternating([a], key, n // 2 + 1)] == [200] * (n // 2) + [429]
    b.stop()  # a graceful stop deletes its heartbeat: the next one of a counts one replica
    _wait_for(lambda: a.app.state.ctx.live_replicas == 1, 2 * POLL_SECONDS + 1)
    clock[0] += 60.0  # a full minute: the bucket holds what one replica now may admit
    assert [r.status_code for r in _post_alternating([a], key, n + 1)] == [200] * n + [429]


def test_a_draining_replica_stops_counting_while_its_requests_finish(two_replicas):
    # b drains (SIGTERM: 503 for new requests, a held one runs on): it admits nothing new, so a
    # should stop sharing the limits with it then, not once its last request has finished
    a, b, clock = two_replicas(tenant_limits_scope="cluster", draining=True, shutdown_grace_seconds=60)
    _wait_for(lambda: a.app.state.ctx.live_replicas == b.app.state.ctx.live_replicas == 2, 5)
    n = 6
    key = _tenant(a, "acme", max_requests_per_minute=n)
    assert [r.status_code for r in _post_alternating([a], key, n // 2 + 1)] == [200] * (n // 2) + [429]
    b_lifecycle = b.app.state.ctx.lifecycle
    with b.tenant_client(key) as cb, ThreadPoolExecutor(1) as pool:
        b.engine.gate.clear()
        try:
            held = pool.submit(cb.post, "/v1/completions", json=BODY)
            _wait_for(lambda: len(b.engine.started) == 1, 5)
            b.server.handle_exit(signal.SIGTERM, None)
            _wait_for(lambda: b_lifecycle.draining, 5)
            refused = cb.post("/v1/completions", json=BODY)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
            gone = _wait_for(lambda: a.app.state.ctx.live_replicas == 1, 5)
            assert gone <= a.app.state.ctx.presence.ttl_seconds
            assert a.registry.replicas_seen(60) == [a.app.state.ctx.presence.replica_id]  # b's row deleted
            clock[0] += 60.0  # a full minute: the bucket holds what one replica now may admit
            assert [r.status_code for r in _post_alternating([a], key, n + 1)] == [200] * n + [429]
            # all of that while b was still draining, its held request running
            assert b.thread.is_alive() and b_lifecycle.in_flight == 1
        finally:
            b.engine.gate.set()
        assert held.result().status_code == 200
    b.thread.join(10)  # the drain ends with its last request: b exits
    assert not b.thread.is_alive()


def test_a_silent_replica_stops_counting_within_the_ttl(two_replicas):
    a, b, clock = two_replicas(tenant_limits_scope="cluster")
    _wait_for(lambda: a.app.state.ctx.live_replicas == 2, 5)
    presence = b.app.state.ctx.presence
    presence._leave = lambda replica_id: None  # as if b died: its row stays behind
    presence.stop()
    gone = _wait_for(lambda: a.app.state.ctx.live_replicas == 1, 10)
    assert gone <= presence.ttl_seconds + 2 * POLL_SECONDS + 1.0  # ttl + a poll, with slack for the CI
    assert a.registry.replicas_seen(60) == [a.app.state.ctx.presence.replica_id]  # b's row was deleted


def test_cluster_scope_shares_the_concurrency_cap(two_replicas):
    # a cap of 2 over two replicas: one request in flight on each, two in all
    a, b, _ = two_replicas(tenant_limits_scope="cluster")
    _wait_for(lambda: a.app.state.ctx.live_replicas == 2, 5)
    key = _tenant(a, "acme", max_concurrent_requests=2)
    with a.tenant_client(key) as ca, b.tenant_client(key) as cb, ThreadPoolExecutor(1) as pool:
        a.engine.gate.clear()
        try:
            held = pool.submit(ca.post, "/v1/completions", json=BODY)
            _wait_for(lambda: len(a.engine.started) == 1, 5)
            second_on_a = ca.post("/v1/completions", json=BODY)
            on_b = cb.post("/v1/completions", json=BODY)
        finally:
            a.engine.gate.set()
        assert held.result().status_code == 200
    assert second_on_a.status_code == 429 and second_on_a.headers["retry-after"] == "1"
    assert second_on_a.json()["error"]["code"] == "rate_limit_exceeded"
    assert "(limit 1)" in second_on_a.json()["error"]["message"]
    assert on_b.status_code == 200


def test_a_replica_cut_off_from_the_database_keeps_admitting_its_last_share(two_replicas):
    # only a's heartbeats fail (keys and limits still load, as from their caches in a short
    # outage); admission reads no database, so a keeps admitting its share of 2 replicas, while
    # b, which still reaches the database, stops counting a after the TTL
    a, b, _ = two_replicas(tenant_limits_scope="cluster")
    _wait_for(lambda: a.app.state.ctx.live_replicas == b.app.state.ctx.live_replicas == 2, 5)
    n = 6
    key = _tenant(a, "acme", max_requests_per_minute=n)
    presence = a.app.state.ctx.presence

    def unreachable(replica_id, ttl):
        raise ConnectionError("database unreachable")

    presence._beat = unreachable
    _wait_for(lambda: presence.failures >= 2, 5)
    assert [r.status_code for r in _post_alternating([a], key, n // 2 + 1)] == [200] * (n // 2) + [429]
    assert presence.live == 2
    _wait_for(lambda: b.app.state.ctx.live_replicas == 1, presence.ttl_seconds + 2 * POLL_SECONDS + 1.0)


def _info(srv, key: str) -> dict:
    with srv.tenant_client(key) as client:
        return client.get("/info").json()


def test_info_reports_the_tenants_cap_and_the_share_this_replica_admits(two_replicas):
    """LoRAX's /info: ``max_concurrent_requests`` is the tenant's cap as configured (as
    x-ratelimit-limit-* gives the whole rate limit), ``replica_max_concurrent_requests`` what the
    replica that answered admits. Checked against admission itself: that many requests held on
    the replica, the next is a 429."""
    a, b, _ = two_replicas(tenant_limits_scope="cluster")
    _wait_for(lambda: a.app.state.ctx.live_replicas == b.app.state.ctx.live_replicas == 2, 5)
    key = _tenant(a, "acme", max_concurrent_requests=4)
    for srv in (a, b):
        info = _info(srv, key)
        assert (info["max_concurrent_requests"], info["replica_max_concurrent_requests"]) == (4, 2)
    share = _info(a, key)["replica_max_concurrent_requests"]
    with a.tenant_client(key) as ca, ThreadPoolExecutor(share) as pool:
        a.engine.gate.clear()
        try:
            held = [pool.submit(ca.post, "/v1/completions", json=BODY) for _ in range(share)]
            _wait_for(lambda: len(a.engine.started) == share, 5)
            one_more = ca.post("/v1/completions", json=BODY)
        finally:
            a.engine.gate.set()
        assert [f.result().status_code for f in held] == [200] * share
    assert one_more.status_code == 429 and f"(limit {share})" in one_more.json()["error"]["message"]
    # a tenant without a cap of its own: the server's per-tenant default, a per-replica setting, in both
    plain = a.make_tenant("plain")
    default = a.app.state.ctx.settings.max_concurrent_requests_per_tenant
    assert {k: _info(a, plain)[k] for k in ("max_concurrent_requests", "replica_max_concurrent_requests")} == {
        "max_concurrent_requests": default, "replica_max_concurrent_requests": default}


def test_info_under_the_replica_scope_reports_the_whole_cap_twice(two_replicas):
    a, b, _ = two_replicas()
    key = _tenant(a, "acme", max_concurrent_requests=4)
    info = _info(b, key)
    assert (info["max_concurrent_requests"], info["replica_max_concurrent_requests"]) == (4, 4)
