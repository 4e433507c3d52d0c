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
lowered one refuses until the used part is below it, never for more than a minute. A bucket in
debt (``wait``'s ``overdraw``) keeps what it owes past its old limit through a change.
"""

from __future__ import annotations

import math

SECONDS_PER_MINUTE = 60.0
# float slack: a cost that fits "exactly" after n seconds of refill must not miss by 1e-15
_EPSILON = 1e-9


class TokenBucket:
    """One per-minute limit's state. Every method takes ``now`` (monotonic seconds) and the
    limit in force, so the caller owns the clock and the limit can change between calls."""

    def __init__(self, limit: float, now: float):
        self.limit = limit
        self.used = 0.0
        self.updated = now
        # per take not yet settled (``take`` -> ``give_back`` or ``settle``): the lowest ``used``
        # has been since, which bounds what the take may still give back
        self._low_since: dict[int, float] = {}
        self._next_take = 0

    def _advance(self, now: float, limit: float) -> None:
        """Refill up to ``now`` at the rate of the limit the bucket had, then apply ``limit``."""
        elapsed = max(0.0, now - self.updated)  # a clock that steps back refills nothing
        self.used = max(0.0, self.used - elapsed * self.limit / SECONDS_PER_MINUTE)
        self.updated = max(self.updated, now)
        if limit != self.limit:
            # an overdraw's debt (used past the old limit) stays owed: a shared limit's share
            # changes whenever a replica joins or leaves, and capping the debt away would let
            # the next request above the share in at once, over the limit in all
            debt = max(0.0, self.used - self.limit)
            self.limit = limit
            self.used = min(self.used - debt, float(limit)) + debt
        self._note_low()

    def _note_low(self) -> None:
        # ``used`` falls only by refill (linearly, between calls), give-backs and a lowered
        # limit, so its lowest since a take is always seen here, at the end of one of those
        for take, low in self._low_since.items():
            if self.used < low:
                self._low_since[take] = self.used

    def wait(self, cost: float, now: float, limit: float, *, overdraw: bool = False) -> float:
        """Seconds until ``cost`` fits (0: it fits now). A cost above the limit never fits (inf),
        unless ``overdraw``: then it fits a full bucket (nothing used), which it puts in debt, to
        refill for ``cost / limit`` minutes. A replica's share of a limit shared by several
        (rate_limits.py) overdraws, so a request within the whole limit is never refused for good."""
        self._advance(now, limit)
        if cost > self.limit:
            if not overdraw:
                return math.inf
            return 0.0 if self.used <= _EPSILON * max(1.0, self.limit) else self.used * SECONDS_PER_MINUTE / self.limit
        over = self.used + cost - self.limit
        if over <= _EPSILON * max(1.0, self.limit):
            return 0.0
        return over * SECONDS_PER_MINUTE / self.limit

    def take(self, cost: float, now: float, limit: float) -> int:
        """Spend ``cost``, which ``wait`` said fits. Returns the take's id, to be settled once
        with ``give_back`` or ``settle``."""
        self._advance(now, limit)
        self.used = min(max(float(self.limit), cost), self.used + cost)  # a cost above the limit: debt
        take, self._next_take = self._next_take, self._next_take + 1
        self._low_since[take] = self.used
        return take

    def give_back(self, amount: float, now: float, take: int | None = None) -> None:
        """Settle ``take``, returning ``amount`` of it that was not used: as much of it as the
        bucket would not have refilled anyway. Charged only what it used, the bucket would sit
        ``amount`` lower, until refill empties it: from then on the two agree. So what comes
        back is ``amount`` capped by the lowest the bucket has been since the take (a request
        outlasting its minute gets nothing: refill has returned its tokens already). Never
        below empty. Without ``take``: ``amount`` as it is (capped only by empty)."""
        self._advance(now, self.limit)
        if take is not None:
            amount = min(amount, self._low_since.pop(take, 0.0))  # unknown or settled: nothing
        self.used = max(0.0, self.used - max(0.0, amount))
        self._note_low()

    def settle(self, take: int) -> None:
        """Settle ``take`` with nothing to give back."""
        self._low_since.pop(take, None)

    def remaining(self, now: float, limit: float) -> float:
        self._advance(now, limit)
        return max(0.0, self.limit - self.used)  # an overdrawn bucket has nothing left, not less

    def reset_seconds(self, now: float, limit: float) -> float:
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
