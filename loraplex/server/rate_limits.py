"""Per-tenant rate limits as OpenAI enforces them: requests per minute (RPM) and tokens per
minute (TPM), each a token bucket (token_bucket.py), checked at admission on this replica.

A request costs one request and, in tokens, its prompt tokens (every prompt, after templating
and truncation) plus ``max_tokens`` for each completion it may write (``n`` per prompt), which is
what OpenAI reserves. When it ends, the part of ``max_tokens`` it did not use is given back, so
the bucket holds what it would hold had each request been charged only what it used (so a
request that outlasts its minute gets nothing back: refill has returned its tokens already).
A request is admitted only if both costs fit; otherwise nothing is taken and the answer is
429 ``rate_limit_exceeded`` with ``Retry-After`` (whole seconds until it would fit by refill
alone; a give-back may let it in sooner).

A request larger than the whole per-minute token budget is a 400, not a 429: it can never fit,
so a 429 would only send clients (OpenAI's SDKs retry 429s by themselves) into retries that must
all fail. The answer names ``max_tokens`` (or the prompt, when the prompt alone is too large).

By default (``tenant_limits_scope`` "replica") limits are per replica, like the concurrency cap:
N replicas behind a balancer admit up to N times a tenant's limits in all. Under "cluster" each
replica is given ``replicas``, the live replicas it counts (cluster_presence.py), and its buckets
hold and refill ``limit / replicas``: the whole deployment admits about the limit when the
balancer spreads a tenant's requests evenly (less when it does not). A request larger than the
share but within the limit is admitted into a full share's bucket, which then refills for longer
(``TokenBucket.wait``'s ``overdraw``), so no request that fits the limit is refused forever.

Answers of a tenant with limits carry OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``
headers, 429s included: the limit is the tenant's, remaining and reset are of the bucket of the
replica that answered (its share, under "cluster").
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from loraplex.server.errors import APIError
from loraplex.server.token_bucket import TokenBucket, go_duration

MAX_TRACKED_BUCKETS = 20_000  # past this, full buckets (equal to new ones) are dropped
REQUESTS, TOKENS = "requests", "tokens"
_SHORT = {REQUESTS: "RPM", TOKENS: "TPM"}


@dataclass(frozen=True)
class TokenCost:
    """What a request reserves from the tokens-per-minute bucket."""

    prompt_tokens: int  # all prompts, as the engine will see them
    max_tokens: int  # per completion
    completions: int  # n per prompt, times the prompts
    max_tokens_given: bool = True  # False: max_tokens defaulted to all the context leaves

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.max_tokens * self.completions

    def reserved(self, limit: int) -> int:
        """What a tokens-per-minute bucket of ``limit`` reserves: the total; for a request whose
        client set no max_tokens, at most one minute's budget (at least its prompt and one token
        per completion). Reserving all the context would refuse every such request under any
        limit below the context length, though most stop long before it."""
        if self.max_tokens_given:
            return self.total
        return max(min(self.total, limit), self.prompt_tokens + self.completions)


@dataclass
class Reservation:
    """What an admitted request took; ``TenantRateLimiter.finish`` or ``cancel`` settles it."""

    tenant: str
    requests: int  # 1 if the tenant had a request limit, else 0
    tokens: int  # reserved from the token bucket (0 without a token limit)
    headers: dict[str, str] = field(default_factory=dict)  # OpenAI's x-ratelimit-* after the take
    settled: bool = False
    # per kind, the bucket taken from and the take's id (TokenBucket.give_back caps what comes
    # back); nothing goes into a bucket forgotten (full) and made anew
    takes: dict[str, tuple[TokenBucket, int]] = field(default_factory=dict)


class TenantRateLimiter:
    """Each tenant's request and token buckets on this replica. ``clock`` (monotonic seconds)
    is injectable so tests control time."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._buckets: dict[tuple[str, str], TokenBucket] = {}
        self._lock = threading.Lock()

    def reserve(self, tenant: str, rpm: int | None, tpm: int | None, cost: TokenCost,
                prompt_param: str = "prompt", replicas: int = 1) -> Reservation | None:
        """Take one request and ``cost.reserved(...)`` tokens, or raise (taking nothing): 400 when
        that exceeds ``tpm`` itself, 429 when it does not fit yet. None: the tenant has no limits.
        ``replicas`` > 1: the limits are shared by that many replicas, this one's buckets hold a
        ``1 / replicas`` share of each (module docstring)."""
        if rpm is None and tpm is None:
            return None
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        # a request without max_tokens reserves at most what one bucket holds: the share
        tokens = cost.reserved(max(1, tpm // replicas)) if tpm is not None else cost.total
        wanted = {kind: _Want(limit, limit / replicas, amount)
                  for kind, limit, amount in ((REQUESTS, rpm, 1), (TOKENS, tpm, tokens)) if limit is not None}
        with self._lock:
            now = self.clock()
            if tpm is not None and tokens > tpm:
                raise _too_large(tenant, tpm, cost, prompt_param)
            waits = {kind: self._bucket(tenant, kind, want.share, now).wait(want.amount, now, want.share,
                                                                             overdraw=replicas > 1)
                     for kind, want in wanted.items()}
            kind = max(waits, key=waits.get)
            if waits[kind] > 0:
                want = wanted[kind]
                used = self._buckets[(tenant, kind)].used
                raise _rate_limited(tenant, kind, want, used, waits[kind], replicas, self._headers(tenant, wanted, now))
            takes = {}
            for kind, want in wanted.items():
                bucket = self._buckets[(tenant, kind)]
                takes[kind] = (bucket, bucket.take(want.amount, now, want.share))
            headers = self._headers(tenant, wanted, now)
        return Reservation(tenant, 1 if rpm is not None else 0, tokens if tpm is not None else 0, headers,
                           takes=takes)

    def finish(self, reservation: Reservation | None, used_tokens: int) -> None:
        """A request ended having used ``used_tokens`` (prompt plus completion): the rest of its
        reservation goes back to the token bucket. Once per reservation."""
        if reservation is None or reservation.settled:
            return
        reservation.settled = True
        self._give_back(reservation, REQUESTS, 0)  # a request that ran stays counted
        self._give_back(reservation, TOKENS, reservation.tokens - used_tokens)

    def cancel(self, reservation: Reservation | None) -> None:
        """A later admission step refused the request: all it took goes back."""
        if reservation is None or reservation.settled:
            return
        reservation.settled = True
        self._give_back(reservation, REQUESTS, reservation.requests)
        self._give_back(reservation, TOKENS, reservation.tokens)

    def used(self, tenant: str, kind: str) -> float:
        """The part of a tenant's bucket not yet refilled (0 for one never used or full)."""
        with self._lock:
            bucket = self._buckets.get((tenant, kind))
            return 0.0 if bucket is None else bucket.used_at(self.clock())

    # --- internals -----------------------------------------------------------------------------

    def _give_back(self, reservation: Reservation, kind: str, amount: float) -> None:
        """Settle the reservation's take of ``kind``, returning ``amount`` of it (0: nothing)."""
        if kind not in reservation.takes:
            return
        taken_from, take = reservation.takes[kind]
        with self._lock:
            if amount <= 0:
                taken_from.settle(take)
            elif self._buckets.get((reservation.tenant, kind)) is taken_from:
                taken_from.give_back(amount, self.clock(), take)
            # else the bucket was forgotten when full: the take had refilled, nothing comes back

    def _bucket(self, tenant: str, kind: str, limit: int, now: float) -> TokenBucket:
        bucket = self._buckets.get((tenant, kind))
        if bucket is None:
            if len(self._buckets) >= MAX_TRACKED_BUCKETS:
                # the tenant at hand keeps its buckets: ``reserve`` looks up the one it made a
                # moment ago (a new one is full) after making the next
                self._buckets = {k: b for k, b in self._buckets.items() if k[0] == tenant or not b.is_full(now)}
            bucket = self._buckets[(tenant, kind)] = TokenBucket(limit, now)
        return bucket

    def _headers(self, tenant: str, wanted: dict[str, _Want], now: float) -> dict[str, str]:
        headers = {}
        for kind, want in wanted.items():
            bucket = self._bucket(tenant, kind, want.share, now)
            headers[f"x-ratelimit-limit-{kind}"] = str(want.limit)
            remaining = bucket.remaining(now, want.share)
            headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(remaining + 1e-9)))
            headers[f"x-ratelimit-reset-{kind}"] = go_duration(bucket.reset_seconds(now, want.share))
        return headers


@dataclass(frozen=True)
class _Want:
    """One limit of a request being reserved: the tenant's limit, the part of it this replica's
    bucket holds (the limit itself under the replica scope) and what the request takes."""

    limit: int
    share: float
    amount: int


def _rate_limited(tenant: str, kind: str, want: _Want, used: float, wait: float, replicas: int,
                  headers: dict[str, str]) -> APIError:
    # OpenAI's words, and its error type ("requests" or "tokens") telling which limit refused
    shared = f" ({want.share:g} on each of {replicas} replicas)" if replicas > 1 else ""
    message = (f"Rate limit reached for tenant {tenant} on {kind} per min ({_SHORT[kind]}): Limit {want.limit}"
               f"{shared}, Used {math.ceil(used - 1e-9)}, Requested {want.amount}. "
               f"Please try again in {go_duration(wait)}.")
    retry_after = max(1, math.ceil(wait - 1e-9))
    return APIError(429, message, type=kind, code="rate_limit_exceeded",
                    headers={"Retry-After": str(retry_after), **headers})


def _too_large(tenant: str, limit: int, cost: TokenCost, prompt_param: str) -> APIError:
    prompt_fits = cost.prompt_tokens + cost.completions <= limit  # at least one token per completion
    fix = "reduce max_tokens" if prompt_fits else "the prompt alone is too large; shorten it"
    message = (f"Request too large for tenant {tenant} on tokens per min (TPM): Limit {limit}, Requested "
               f"{cost.total} ({cost.prompt_tokens} prompt tokens + max_tokens {cost.max_tokens} x "
               f"{cost.completions} completions). It can never fit this limit: {fix}.")
    return APIError(400, message, param="max_tokens" if prompt_fits else prompt_param, code="request_too_large")
