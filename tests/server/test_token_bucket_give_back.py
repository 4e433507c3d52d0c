"""Give-backs against a brute-force statement of what they are for: a bucket that took each
request's reservation and gave back its unused part at the end must hold what a bucket holds
that had been charged, at admission, only what each request really used. Brute force: integer
ticks, each refilling limit/60 per second's worth, charged the real use at the take."""

from __future__ import annotations

import random

import pytest

from loraplex.server.token_bucket import TokenBucket

TICK_MS = 10
SCALE = 60_000 // TICK_MS  # scaled units: one tick refills exactly `limit` of them


class ChargedWhatItUsed:
    """The bucket as if each request had been charged its real use when it was admitted."""

    def __init__(self, limit: int):
        self.limit, self.used, self.ticks = limit, 0, 0

    def advance_to(self, ticks: int) -> None:
        while self.ticks < ticks:
            self.used = max(0, self.used - self.limit)
            self.ticks += 1

    def take(self, amount: int) -> None:
        self.used += amount * SCALE


def _run(seed: int, overlapping: bool):
    """Random requests (reserved, really used, duration) on both buckets; yields (bucket's
    used, the brute force's) whenever no request is open."""
    rng = random.Random(seed)
    limit = rng.choice([60, 100, 1000])
    bucket, reference = TokenBucket(limit, 0.0), ChargedWhatItUsed(limit)
    open_takes: list[tuple[int, int, int, int]] = []  # (ends at tick, reserved, used, take)
    tick = 0
    for _ in range(200):
        tick += rng.choice([0, 1, 5, 50, 500, 3000])
        now = tick * TICK_MS / 1000
        reference.advance_to(tick)
        for end in sorted(t for t in open_takes if t[0] <= tick):  # requests ending by now
            open_takes.remove(end)
            _, reserved, used, take = end
            bucket.give_back(reserved - used, now, take)
        if not open_takes:
            yield bucket.used_at(now), reference.used / SCALE, limit
        reserved = rng.randint(1, limit)
        if (overlapping or not open_takes) and bucket.wait(reserved, now, limit) == 0:
            used = rng.randint(0, reserved)
            take = bucket.take(reserved, now, limit)
            reference.take(used)
            open_takes.append((tick + rng.choice([0, 10, 300, 3000, 9000]), reserved, used, take))


@pytest.mark.parametrize("seed", range(30))
def test_one_request_at_a_time_the_bucket_holds_what_charging_its_use_would(seed):
    for used, expected, _ in _run(seed, overlapping=False):
        assert used == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("seed", range(30))
def test_overlapping_requests_are_never_charged_more_than_they_used(seed):
    # each give-back is capped by the lowest the bucket has been since its own take; with
    # several requests open that may return a little too much (at most an eighth of the limit
    # in these runs), never too little: the tenant is never held back for tokens it did not use
    for used, expected, limit in _run(seed, overlapping=True):
        assert expected - limit / 6 <= used <= expected + 1e-6


def test_a_take_that_refilled_before_it_ended_gives_nothing_back():
    bucket = TokenBucket(100, 0.0)
    first = bucket.take(93, 0.0, 100)
    bucket.take(93, 60.0, 100)  # the first refilled entirely by 55.8 s
    bucket.give_back(89, 60.0, first)
    assert bucket.used_at(60.0) == pytest.approx(93)


def test_concurrent_takes_give_back_what_charging_their_use_would_have_left():
    # ten requests reserve 100 each of 1000 TPM at once and use 20 each; after 30 s (500
    # refilled) they end: charged 20 each, the bucket would have emptied after 12 s
    bucket = TokenBucket(1000, 0.0)
    takes = [bucket.take(100, 0.0, 1000) for _ in range(10)]
    for take in takes:
        bucket.give_back(80, 30.0, take)
    assert bucket.used_at(30.0) == pytest.approx(0)
