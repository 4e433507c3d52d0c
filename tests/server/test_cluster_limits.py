"""Tenant limits shared by replicas, without HTTP: a replica's share of each per-minute bucket
and of the concurrency cap, a request larger than the share, and the heartbeat thread that
keeps the live count (a failing database leaves it as it was). Expectations are worked out from
the limits: a share of ``limit / replicas`` that refills in a minute."""

from __future__ import annotations

import math
import threading
import time

import pytest

from loraplex.server.cluster_presence import ClusterPresence
from loraplex.server.errors import APIError
from loraplex.server.rate_limits import TenantRateLimiter, TokenCost
from loraplex.server.tenant_limits import TenantLimits

ONE_TOKEN = TokenCost(prompt_tokens=1, max_tokens=0, completions=0)


def _limiter():
    now = [1000.0]
    return TenantRateLimiter(clock=lambda: now[0]), now


def _admitted(limiter, count: int, **kwargs) -> int:
    done = 0
    for _ in range(count):
        try:
            limiter.reserve("t", cost=kwargs.get("cost", ONE_TOKEN), rpm=kwargs.get("rpm"), tpm=kwargs.get("tpm"),
                            replicas=kwargs.get("replicas", 1))
        except APIError as err:
            assert err.status == 429
            continue
        done += 1
    return done


@pytest.mark.parametrize("rpm,replicas,share", [(12, 1, 12), (12, 2, 6), (12, 3, 4), (10, 4, 2)])
def test_a_replica_admits_its_share_of_a_minute(rpm, replicas, share):
    # a share of 10 / 4 = 2.5 admits 2 whole requests at once: never more than the limit in all
    limiter, _ = _limiter()
    assert _admitted(limiter, rpm + 5, rpm=rpm, replicas=replicas) == share


def test_the_share_refills_at_the_share_rate():
    limiter, now = _limiter()
    assert _admitted(limiter, 10, rpm=12, replicas=2) == 6
    now[0] += 10.0  # 12 a minute over two replicas: one request per 10 s here
    assert _admitted(limiter, 3, rpm=12, replicas=2) == 1


def test_a_refusal_names_the_limit_and_the_share_and_waits_for_the_share_to_refill():
    limiter, _ = _limiter()
    _admitted(limiter, 2, rpm=4, replicas=2)
    with pytest.raises(APIError) as refused:
        limiter.reserve("t", 4, None, ONE_TOKEN, replicas=2)
    err = refused.value
    assert err.status == 429 and err.code == "rate_limit_exceeded"
    assert "Limit 4 (2 on each of 2 replicas), Used 2, Requested 1" in err.message
    assert err.headers["Retry-After"] == "30"  # 2 a minute here: 30 s per request
    assert err.headers["x-ratelimit-limit-requests"] == "4"  # the tenant's limit
    assert err.headers["x-ratelimit-remaining-requests"] == "0"  # this replica's share


def test_a_request_above_the_share_but_within_the_limit_waits_for_a_full_share():
    # 1000 tokens a minute over 4 replicas: 250 each; a 600-token request fits the limit, so it
    # must be admitted some time, into a full share, which then refills for 600 / 250 minutes
    limiter, now = _limiter()
    big = TokenCost(prompt_tokens=100, max_tokens=500, completions=1)
    assert limiter.reserve("t", None, 1000, big, replicas=4) is not None
    with pytest.raises(APIError) as refused:
        limiter.reserve("t", None, 1000, ONE_TOKEN, replicas=4)
    assert refused.value.headers["Retry-After"] == str(math.ceil(60 * (600 + 1 - 250) / 250))  # back under 250
    now[0] += 60 * 600 / 250  # refilled whole
    assert limiter.reserve("t", None, 1000, big, replicas=4) is not None


def test_a_request_above_the_whole_limit_is_still_a_400_under_any_share():
    limiter, _ = _limiter()
    with pytest.raises(APIError) as refused:
        limiter.reserve("t", None, 1000, TokenCost(prompt_tokens=10, max_tokens=1000, completions=1), replicas=4)
    assert refused.value.status == 400 and refused.value.code == "request_too_large"


def test_replica_count_below_one_is_a_programming_error():
    limiter, _ = _limiter()
    with pytest.raises(ValueError):
        limiter.reserve("t", 5, None, ONE_TOKEN, replicas=0)


@pytest.mark.parametrize("cap,replicas,share", [(8, 1, 8), (8, 2, 4), (5, 2, 2), (3, 4, 1), (None, 3, None)])
def test_the_concurrency_cap_is_shared_rounding_down_but_never_to_zero(cap, replicas, share):
    assert TenantLimits(max_concurrent_requests=cap).concurrency_cap(replicas) == share


class FlakyRegistry:
    """Heartbeats answer ``live`` or raise while ``down``; leaves are recorded."""

    def __init__(self, live: int):
        self.live, self.down, self.left, self.beats = live, False, [], 0
        self.beat_seen = threading.Event()

    def beat(self, replica_id: str, ttl: float) -> int:
        self.beats += 1
        self.beat_seen.set()
        if self.down:
            raise ConnectionError("database unreachable")
        return self.live

    def leave(self, replica_id: str) -> None:
        self.left.append(replica_id)


def test_presence_counts_from_the_first_heartbeat_and_leaves_at_stop():
    registry = FlakyRegistry(live=3)
    presence = ClusterPresence(registry.beat, registry.leave, 0.05, replica_id="me").start()
    try:
        assert presence.live == 3 and registry.beats == 1  # before start returned
        assert presence.ttl_seconds == pytest.approx(3 * 0.05)
        registry.live = 2
        deadline = time.monotonic() + 5
        while presence.live != 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert presence.live == 2  # the thread's heartbeats
    finally:
        presence.stop()
    assert registry.left == ["me"]


def test_a_failing_database_keeps_the_last_count_and_admission_goes_on():
    registry = FlakyRegistry(live=2)
    presence = ClusterPresence(registry.beat, registry.leave, 60, replica_id="me")
    assert presence.beat_once() and presence.live == 2
    registry.down = True
    assert not presence.beat_once() and not presence.beat_once()
    assert presence.live == 2 and presence.failures == 2
    registry.down, registry.live = False, 1
    assert presence.beat_once() and presence.live == 1 and presence.failures == 0


def test_a_database_down_at_start_counts_this_replica_alone_until_a_heartbeat_gets_through():
    registry = FlakyRegistry(live=4)
    registry.down = True
    presence = ClusterPresence(registry.beat, registry.leave, 60, replica_id="me").start()
    try:
        assert presence.live == 1
    finally:
        registry.leave = lambda replica_id: (_ for _ in ()).throw(ConnectionError("still down"))
        presence._leave = registry.leave
        presence.stop()  # a failed leave is logged, not raised


@pytest.mark.parametrize("new_replicas", [5, 2])
def test_a_pod_joining_or_leaving_does_not_forgive_an_overdrawn_share(new_replicas):
    # 1000 tokens a minute over 4 replicas: a 600-token request overdraws a 250 share (350 past
    # it). The count then changes (a pod starts or stops): what was used stays used, capped at the
    # new share as any used part is, but the 350 owed past the old share is still owed
    limiter, _ = _limiter()
    big = TokenCost(prompt_tokens=100, max_tokens=500, completions=1)
    assert limiter.reserve("t", None, 1000, big, replicas=4) is not None
    share = 1000 / new_replicas
    still_used = min(250, share) + (600 - 250)
    with pytest.raises(APIError) as refused:
        limiter.reserve("t", None, 1000, ONE_TOKEN, replicas=new_replicas)
    assert refused.value.headers["Retry-After"] == str(math.ceil(60 * (still_used + 1 - share) / share - 1e-9))
