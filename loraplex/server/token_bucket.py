"""The arithmetic of one per-minute limit: a token bucket.

A bucket of ``limit`` holds up to ``limit`` units and refills continuously at ``limit / 60``
units per second, so a tenant idle for a minute may spend its whole minute at once (a burst of
``limit``) and one that keeps spending gets exactly ``limit`` per minute. This is how OpenAI's
own headers behave: ``x-ratelimit-reset-requests`` is the time the used part takes to refill
(60 s / limit per request), not the end of a fixed window. A sliding window log would refuse the
same totals but needs a record per request and cannot express "give back the unused tokens";
the bucket is two numbers.

The bucket is kept as ``used`` (the part not yet refilled, 0 <= used <= limit) rather than as
what is left, so a changed limit has one rule: what was used stays used, capped at the new
limit, and refills at the new rate from then on. A raised limit adds its difference at once; a
lowered one refuses until the used part is below it, never for more than a minute.
"""

from __future__ import annotations

import math

SECONDS_PER_MINUTE = 60.0
# float slack: a cost that fits "exactly" after n seconds of refill must not miss by 1e-15
_EPSILON = 1e-9


class TokenBucket:
    """One per-minute limit's state. Every method takes ``now`` (monotonic seconds) and the
    limit in force, so the caller owns the clock and the limit can change between calls."""

    def __init__(self, limit: int, now: float):
        self.limit = limit
        self.used = 0.0
        self.updated = now
        # all the refill since creation at the rates in force, whether or not the bucket was
        # empty: how much of an earlier take has refilled since (``outstanding``)
        self.refilled = 0.0

    def _advance(self, now: float, limit: int) -> None:
        """Refill up to ``now`` at the rate of the limit the bucket had, then apply ``limit``."""
        elapsed = max(0.0, now - self.updated)  # a clock that steps back refills nothing
        refill = elapsed * self.limit / SECONDS_PER_MINUTE
        self.refilled += refill
        self.used = max(0.0, self.used - refill)
        self.updated = max(self.updated, now)
        if limit != self.limit:
            self.limit = limit
            self.used = min(self.used, float(limit))

    def wait(self, cost: float, now: float, limit: int) -> float:
        """Seconds until ``cost`` fits (0: it fits now). A cost above the limit never fits: inf."""
        self._advance(now, limit)
        if cost > self.limit:
            return math.inf
        over = self.used + cost - self.limit
        if over <= _EPSILON * max(1.0, self.limit):
            return 0.0
        return over * SECONDS_PER_MINUTE / self.limit

    def take(self, cost: float, now: float, limit: int) -> tuple[float, float]:
        """Spend ``cost``, which ``wait`` said fits. Returns the take's mark for ``give_back``."""
        self._advance(now, limit)
        self.used = min(float(self.limit), self.used + cost)
        return self.used, self.refilled

    def outstanding(self, mark: tuple[float, float], now: float) -> float:
        """How much of the take ``mark`` came from has not refilled yet. Takes refill in the
        order they were made: a take that left the bucket at ``level`` has refilled entirely
        once ``level`` has refilled since."""
        self._advance(now, self.limit)
        level, refilled_then = mark
        return max(0.0, level - (self.refilled - refilled_then))

    def give_back(self, amount: float, now: float, mark: tuple[float, float] | None = None) -> None:
        """Return ``amount`` spent earlier and not used; never below empty. With the take's
        ``mark``, at most the part of that take that has not refilled yet: what refilled
        already came back once, and giving it back again would let the tenant spend it twice
        (a long request's unused max_tokens, returned after its minute has passed)."""
        if mark is not None:
            amount = min(amount, self.outstanding(mark, now))
        self._advance(now, self.limit)
        self.used = max(0.0, self.used - amount)

    def remaining(self, now: float, limit: int) -> float:
        self._advance(now, limit)
        return self.limit - self.used

    def reset_seconds(self, now: float, limit: int) -> float:
        """Seconds until the bucket is full again (OpenAI's ``x-ratelimit-reset-*``)."""
        self._advance(now, limit)
        return self.used * SECONDS_PER_MINUTE / self.limit

    def used_at(self, now: float) -> float:
        """The part not yet refilled at ``now``."""
        self._advance(now, self.limit)
        return self.used

    def is_full(self, now: float) -> bool:
        """Whether the bucket is as a new one would be (so forgetting it changes nothing)."""
        self._advance(now, self.limit)
        return self.used <= 0.0


def go_duration(seconds: float) -> str:
    """``seconds`` as OpenAI writes its reset headers (Go's ``time.Duration``): ``12ms``,
    ``1.5s``, ``6m0s``; rounded up to the millisecond, so a bucket not yet full never says 0."""
    ms = math.ceil(seconds * 1000 - _EPSILON) if seconds > 0 else 0
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"
