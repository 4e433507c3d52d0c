"""The token bucket's arithmetic against a brute-force statement of it: time advanced in 10 ms
ticks, in integers, refilling limit/60 per second and never below empty; a cost fits when
used + cost <= limit; a changed limit keeps what was used, capped at the new limit. Plus the
cases spelled out (burst, refill, give-back, limit changes) and OpenAI's duration format."""

from __future__ import annotations

import math
import random

import pytest

from loraplex.server.token_bucket import TokenBucket, go_duration

TICK_MS = 10
SCALE = 60_000 // TICK_MS  # units are scaled so one tick refills exactly `limit` scaled units


class Reference:
    """The bucket, brute force: integers only, one tick at a time."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0  # scaled units
        self.ticks = 0

    def advance_to(self, ticks: int) -> None:
        while self.ticks < ticks:
            self.used = max(0, self.used - self.limit)
            self.ticks += 1

    def set_limit(self, limit: int) -> None:
        self.limit = limit
        self.used = min(self.used, limit * SCALE)

    def fits(self, cost: int) -> bool:
        return self.used + cost * SCALE <= self.limit * SCALE

    def ticks_until_fits(self, cost: int) -> int | None:
        if cost > self.limit:
            return None
        used, k = self.used, 0
        while used + cost * SCALE > self.limit * SCALE:
            used = max(0, used - self.limit)
            k += 1
        return k

    def take(self, cost: int) -> None:
        self.used += cost * SCALE

    def give_back(self, amount: int) -> None:
        self.used = max(0, self.used - amount * SCALE)

    def remaining(self) -> float:
        return (self.limit * SCALE - self.used) / SCALE


@pytest.mark.parametrize("seed", range(12))
def test_the_bucket_matches_the_brute_force_statement(seed):
    rng = random.Random(seed)
    limit = rng.choice([1, 2, 3, 7, 10, 60, 100])
    bucket, ref = TokenBucket(limit, 0.0), Reference(limit)
    ticks = 0
    taken: list[int] = []
    for _ in range(150):
        ticks += rng.choice([0, 0, 1, 3, 50, 200, 700, 3000])
        now = ticks * TICK_MS / 1000
        ref.advance_to(ticks)
        op = rng.random()
        if op < 0.1:  # the operator changes the limit between two requests
            limit = rng.choice([1, 2, 5, 10, 30, 100, 200])
            ref.set_limit(limit)
        elif op < 0.25 and taken:  # a finished request gives back part of what it took
            amount = rng.randint(0, taken.pop())
            bucket.give_back(amount, now)
            ref.give_back(amount)
        else:
            cost = rng.randint(0, limit + 2)
            wait = bucket.wait(cost, now, limit)
            expected = ref.ticks_until_fits(cost)
            if expected is None:
                assert wait == math.inf
            elif expected == 0:
                assert wait == 0 and ref.fits(cost)
                bucket.take(cost, now, limit)
                ref.take(cost)
                taken.append(cost)
            else:  # the first tick at which it fits is the one the wait ends in
                assert (expected - 1) * TICK_MS / 1000 < wait <= expected * TICK_MS / 1000 + 1e-9
        assert bucket.remaining(now, limit) == pytest.approx(ref.remaining(), abs=1e-6)
        assert 0 <= bucket.remaining(now, limit) <= limit + 1e-9
        reset = bucket.reset_seconds(now, limit)
        assert reset == pytest.approx((limit - ref.remaining()) * 60 / limit, abs=1e-6)
        assert 0 <= reset <= 60 + 1e-9


def test_a_burst_of_the_whole_minute_then_one_per_refill():
    b = TokenBucket(3, 0.0)
    for _ in range(3):
        assert b.wait(1, 0.0, 3) == 0
        b.take(1, 0.0, 3)
    assert b.remaining(0.0, 3) == 0
    assert b.wait(1, 0.0, 3) == pytest.approx(20.0)  # 3 per minute: one every 20 s
    assert b.wait(1, 19.0, 3) == pytest.approx(1.0)
    assert b.wait(1, 20.0, 3) == 0
    assert b.reset_seconds(20.0, 3) == pytest.approx(40.0)
    assert b.remaining(3600.0, 3) == 3  # never more than the limit, however long it waits


def test_give_back_returns_the_unused_part_and_never_goes_below_empty():
    b = TokenBucket(100, 0.0)
    b.take(90, 0.0, 100)
    assert b.wait(20, 0.0, 100) == pytest.approx(6.0)  # 10 over, at 100 per 60 s
    b.give_back(80, 0.0)  # it used 10 of its 90
    assert b.remaining(0.0, 100) == pytest.approx(90)
    assert b.wait(20, 0.0, 100) == 0
    b.give_back(1000, 0.0)
    assert b.remaining(0.0, 100) == 100 and b.used_at(0.0) == 0


def test_a_lowered_limit_refuses_until_the_used_part_is_under_it_and_a_raised_one_applies_at_once():
    b = TokenBucket(10, 0.0)
    b.take(8, 0.0, 10)
    assert b.remaining(0.0, 5) == 0  # lowered to 5 with 8 used: full, and no more than full
    assert b.wait(1, 0.0, 5) == pytest.approx(12.0)  # 1 over at 5 per minute
    assert b.reset_seconds(0.0, 5) == pytest.approx(60.0)  # never more than a minute
    assert b.remaining(0.0, 20) == pytest.approx(15)  # raised to 20: the 5 used stay used, 15 free now
    assert b.wait(15, 0.0, 20) == 0
    assert b.wait(21, 0.0, 20) == math.inf


def test_a_clock_that_steps_back_refills_nothing():
    b = TokenBucket(60, 10.0)
    b.take(60, 10.0, 60)
    assert b.remaining(9.0, 60) == 0
    assert b.remaining(11.0, 60) == pytest.approx(1)


@pytest.mark.parametrize("seconds,text", [
    (0, "0s"), (0.012, "12ms"), (0.009, "9ms"), (0.0001, "1ms"), (1, "1s"), (17.28, "17.28s"),
    (60, "1m0s"), (360, "6m0s"), (61.5, "1m1.5s"), (0.9999, "1s"),
])
def test_durations_are_written_as_openai_writes_them(seconds, text):
    # OpenAI's headers carry Go durations: "12ms", "17.28s", "6m0s" (its rate-limit guide)
    assert go_duration(seconds) == text


def test_an_overdrawing_bucket_takes_a_cost_above_its_limit_only_when_full_and_refills_it_whole():
    b = TokenBucket(20, 0.0)
    assert b.wait(50, 0.0, 20) == math.inf  # without overdraw: never
    b.take(5, 0.0, 20)
    assert b.wait(50, 0.0, 20, overdraw=True) == pytest.approx(15.0)  # until the 5 used refilled: 5 at 20/min
    assert b.wait(50, 15.0, 20, overdraw=True) == 0
    b.take(50, 15.0, 20)
    assert b.remaining(15.0, 20) == 0  # in debt: nothing left, not less than nothing
    assert b.reset_seconds(15.0, 20) == pytest.approx(150.0)  # 50 at 20 a minute
    assert b.wait(1, 15.0, 20, overdraw=True) == pytest.approx((50 + 1 - 20) * 3.0)  # 3 s per unit
    assert b.wait(5, 15.0 + 150.0 - 15.0, 20) == 0  # after 135 s: 5 used, 15 free
