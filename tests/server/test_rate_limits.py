"""The per-tenant limiter on an injected clock: both limits must fit or nothing is taken, the
429's Retry-After and OpenAI's x-ratelimit-* headers, the 400 for a request that can never fit,
give-back on finish, full return on cancel, tenants apart."""

from __future__ import annotations

import pytest

from loraplex.server.errors import APIError
from loraplex.server.rate_limits import REQUESTS, TOKENS, TenantRateLimiter, TokenCost


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def limiter(clock):
    return TenantRateLimiter(clock)


def cost(prompt: int, max_tokens: int, completions: int = 1) -> TokenCost:
    return TokenCost(prompt, max_tokens, completions)


def _refused(limiter, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as err:
        limiter.reserve(*args, **kwargs)
    return err.value


def test_no_limits_no_reservation(limiter):
    assert limiter.reserve("acme", None, None, cost(10**9, 10**9)) is None
    assert limiter.used("acme", REQUESTS) == 0 and limiter.used("acme", TOKENS) == 0


def test_the_headers_are_openais(limiter):
    # OpenAI's answer at 5000 RPM and 160000 TPM after one request of 24 tokens:
    # remaining 4999 and 159976, reset 12ms (60 s / 5000) and 9ms (24 x 60 s / 160000)
    r = limiter.reserve("acme", 5000, 160_000, cost(20, 4))
    assert r.headers == {
        "x-ratelimit-limit-requests": "5000", "x-ratelimit-remaining-requests": "4999",
        "x-ratelimit-reset-requests": "12ms",
        "x-ratelimit-limit-tokens": "160000", "x-ratelimit-remaining-tokens": "159976",
        "x-ratelimit-reset-tokens": "9ms",
    }
    only_rpm = limiter.reserve("globex", 2, None, cost(5, 5))
    assert set(only_rpm.headers) == {"x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                                     "x-ratelimit-reset-requests"}
    assert only_rpm.tokens == 0 and only_rpm.requests == 1


def test_requests_per_minute_refuse_the_third_and_take_nothing(limiter, clock):
    for expected_remaining in ("1", "0"):
        r = limiter.reserve("acme", 2, None, cost(3, 5))
        assert r.headers["x-ratelimit-remaining-requests"] == expected_remaining
    clock.now += 10  # 1/3 of a request refilled: the next fits in 20 s
    err = _refused(limiter, "acme", 2, None, cost(3, 5))
    assert (err.status, err.code, err.type) == (429, "rate_limit_exceeded", "requests")
    assert err.headers["Retry-After"] == "20"
    assert err.headers["x-ratelimit-remaining-requests"] == "0"
    assert err.headers["x-ratelimit-reset-requests"] == "50s"
    assert "requests per min (RPM): Limit 2, Used 2, Requested 1" in err.message
    assert limiter.used("acme", REQUESTS) == pytest.approx(2 - 1 / 3)  # the refusal took nothing
    assert limiter.reserve("globex", 2, None, cost(3, 5)) is not None  # another tenant's own bucket
    clock.now += 20
    assert limiter.reserve("acme", 2, None, cost(3, 5)) is not None


def test_both_must_fit_or_neither_is_taken(limiter, clock):
    limiter.reserve("acme", 10, 100, cost(10, 80))  # 90 of 100 tokens
    err = _refused(limiter, "acme", 10, 100, cost(5, 10))  # 15 tokens: 5 over
    assert (err.status, err.type) == (429, "tokens")
    assert err.headers["Retry-After"] == "3"  # 5 tokens at 100 per minute: 3 s
    assert "tokens per min (TPM): Limit 100, Used 90, Requested 15" in err.message
    assert limiter.used("acme", REQUESTS) == 1  # the request that fitted was not taken either
    assert limiter.used("acme", TOKENS) == 90
    clock.now += 3
    assert limiter.reserve("acme", 10, 100, cost(5, 10)).headers["x-ratelimit-remaining-tokens"] == "0"


def test_the_longest_wait_is_the_one_reported(limiter):
    limiter.reserve("acme", 1, 60, cost(30, 30))
    err = _refused(limiter, "acme", 1, 60, cost(1, 1))  # requests: 60 s; tokens: 2 s
    assert err.type == "requests" and err.headers["Retry-After"] == "60"


def test_a_request_larger_than_the_minute_is_a_400_naming_what_to_cut(limiter):
    err = _refused(limiter, "acme", 5, 100, cost(40, 31, 2))  # 40 + 62 = 102
    assert (err.status, err.code, err.param) == (400, "request_too_large", "max_tokens")
    assert "Limit 100, Requested 102" in err.message and "never fit" in err.message
    err = _refused(limiter, "acme", 5, 100, cost(100, 1), prompt_param="messages")  # the prompt alone
    assert err.param == "messages"
    assert limiter.used("acme", REQUESTS) == 0 and limiter.used("acme", TOKENS) == 0
    assert limiter.reserve("acme", 5, 100, cost(40, 30, 2)) is not None  # exactly the limit fits


def test_finish_gives_back_the_unused_part_once(limiter):
    r = limiter.reserve("acme", None, 100, cost(10, 40, 2))  # 90 reserved
    assert limiter.used("acme", TOKENS) == 90
    limiter.finish(r, used_tokens=10 + 7)  # 7 completion tokens in all
    assert limiter.used("acme", TOKENS) == pytest.approx(17)
    limiter.finish(r, used_tokens=0)  # settled: a second call changes nothing
    assert limiter.used("acme", TOKENS) == pytest.approx(17)
    limiter.finish(None, 5)  # a tenant without limits has no reservation


def test_cancel_returns_the_request_and_all_tokens(limiter):
    r = limiter.reserve("acme", 3, 100, cost(10, 40))
    limiter.cancel(r)
    assert limiter.used("acme", REQUESTS) == 0 and limiter.used("acme", TOKENS) == 0
    limiter.cancel(r)
    limiter.finish(r, 0)
    assert limiter.used("acme", REQUESTS) == 0 and limiter.used("acme", TOKENS) == 0


def test_limits_changed_between_requests(limiter, clock):
    for _ in range(4):
        limiter.reserve("acme", 10, None, cost(1, 1))
    err = _refused(limiter, "acme", 2, None, cost(1, 1))  # lowered to 2 with 4 used: the next waits
    assert err.headers["Retry-After"] == "30" and err.headers["x-ratelimit-remaining-requests"] == "0"
    r = limiter.reserve("acme", 20, None, cost(1, 1))  # raised: at once (2 used + this one)
    assert r.headers["x-ratelimit-remaining-requests"] == "17"
    limiter.reserve("acme", None, None, cost(1, 1))  # unlimited: no bucket is touched
    assert limiter.used("acme", REQUESTS) == pytest.approx(3)


def test_forgetting_full_buckets_never_drops_the_tenant_being_admitted(limiter, monkeypatch):
    # at the bound, the second bucket of a tenant with both limits used to forget the first
    # (new, so full) and the take that followed raised KeyError: a 500 instead of an answer
    monkeypatch.setattr("loraplex.server.rate_limits.MAX_TRACKED_BUCKETS", 4)
    limiter.reserve("acme", 10, 100, cost(5, 5))  # two buckets in use
    limiter.reserve("globex", 10, None, cost(5, 5))  # a third
    r = limiter.reserve("initech", 10, 100, cost(5, 5))
    assert r.headers["x-ratelimit-remaining-requests"] == "9" and r.headers["x-ratelimit-remaining-tokens"] == "90"
    assert limiter.used("initech", REQUESTS) == 1 and limiter.used("initech", TOKENS) == 10
    assert limiter.used("acme", TOKENS) == 10  # in use: kept


def test_a_give_back_returns_only_what_has_not_refilled_since(limiter, clock):
    # brute force: charged at admission what it really used (4 of 93 reserved), the first
    # request would have refilled long before the second; so the second's 93 fill the bucket
    # and a third is refused. Given back in full after its minute, the first request's 89
    # unused tokens were returned twice (once by refill) and the third got in: 186 in no time
    first = limiter.reserve("acme", None, 100, cost(3, 90))
    clock.now += 60
    limiter.reserve("acme", None, 100, cost(3, 90))
    limiter.finish(first, used_tokens=4)
    assert limiter.used("acme", TOKENS) == pytest.approx(93)
    err = _refused(limiter, "acme", None, 100, cost(3, 90))
    assert (err.status, err.type) == (429, "tokens")


def test_a_give_back_after_part_of_the_minute_returns_what_is_left_of_the_take(limiter, clock):
    limiter.reserve("acme", None, 100, cost(10, 40))  # 50 before it
    r = limiter.reserve("acme", None, 100, cost(5, 35))  # 40 reserved; the bucket at 90
    clock.now += 30  # 50 refilled: the first take, in full (it came first)
    limiter.finish(r, used_tokens=10)  # 30 unused, all of it still in the bucket
    # brute force: charged 50, then 10, then 30 s of refill: 60 - 50 = 10 left
    assert limiter.used("acme", TOKENS) == pytest.approx(10)
    clock.now += 3  # 5 more refilled: 5 of the give-back's take left; its 30 unused came back
    assert limiter.used("acme", TOKENS) == pytest.approx(5)


def test_without_max_tokens_a_request_reserves_at_most_the_minute(limiter):
    open_ended = TokenCost(30, 4000, 1, max_tokens_given=False)  # max_tokens defaulted to the context
    reservation = limiter.reserve("acme", None, 100, open_ended)
    assert reservation.tokens == 100 and limiter.used("acme", TOKENS) == 100
    limiter.finish(reservation, 30 + 12)
    assert limiter.used("acme", TOKENS) == 42  # charged what it used
    err = _refused(limiter, "acme", None, 100, TokenCost(120, 4000, 1, max_tokens_given=False),
                   prompt_param="messages")
    assert (err.status, err.code, err.param) == (400, "request_too_large", "messages")  # the prompt alone
    assert TokenCost(30, 4000, 2, max_tokens_given=False).reserved(20) == 32  # the prompt, a token each
    assert TokenCost(30, 40, 1).reserved(50) == 70  # a given max_tokens is reserved whole
