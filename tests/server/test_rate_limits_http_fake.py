"""Per-tenant rate limits over HTTP (fake engine, real registry): requests per minute on every
generating route, streamed or not; tokens per minute with the give-back of a finished request;
OpenAI's x-ratelimit-* headers; a refusal takes nothing; changes apply live. The limiter's clock
is frozen, so nothing refills while a test runs."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server.conftest import start_server
from tests.server.fakes import LETTERS, GatedEngine

CHAT = [{"role": "user", "content": "hi"}]
ROUTES = [
    ("/v1/completions", {"model": "fake-model", "prompt": "ab", "max_tokens": 1}),
    ("/v1/completions", {"model": "fake-model", "prompt": "ab", "max_tokens": 1, "stream": True}),
    ("/v1/chat/completions", {"model": "fake-model", "messages": CHAT, "max_tokens": 1}),
    ("/v1/chat/completions", {"model": "fake-model", "messages": CHAT, "max_tokens": 1, "stream": True}),
    ("/v1/responses", {"model": "fake-model", "input": "hi", "max_output_tokens": 1}),
    ("/v1/responses", {"model": "fake-model", "input": "hi", "max_output_tokens": 1, "stream": True}),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 1}}),
    ("/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": 1}}),
]
REQUEST_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests")
TOKEN_HEADERS = ("x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens")


def _freeze(srv) -> None:
    frozen = time.monotonic()
    srv.app.state.ctx.rate_limiter.clock = lambda: frozen


def _patch(srv, tenant: str, body: dict) -> None:
    with srv.admin() as c:
        r = c.patch(f"/admin/v1/tenants/{tenant}", json=body)
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("rate"), GatedEngine())
    _freeze(server)
    yield server
    server.stop()


@pytest.mark.parametrize("path,body", ROUTES, ids=[f"{p}{'-stream' if b.get('stream') else ''}" for p, b in ROUTES])
def test_the_third_request_in_a_minute_is_refused_on_every_route(srv, path, body):
    tenant = f"rpm{ROUTES.index((path, body))}"
    key = srv.make_tenant(tenant)
    _patch(srv, tenant, {"max_requests_per_minute": 2})
    with srv.tenant_client(key) as c:
        answers = [c.post(path, json=body) for _ in range(3)]
    assert [r.status_code for r in answers] == [200, 200, 429], answers[-1].text
    for r, remaining, reset in zip(answers, ("1", "0"), ("30s", "1m0s")):  # 30 s per request at 2 RPM
        assert (r.headers["x-ratelimit-limit-requests"], r.headers["x-ratelimit-remaining-requests"],
                r.headers["x-ratelimit-reset-requests"]) == ("2", remaining, reset)
        assert not any(h in r.headers for h in TOKEN_HEADERS)  # no token limit: no token headers
    refused = answers[2]
    assert refused.headers["retry-after"] == "30"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    error = refused.json()
    if path.startswith("/v1/"):
        assert error["error"]["code"] == "rate_limit_exceeded" and error["error"]["type"] == "requests"
        assert "Limit 2, Used 2, Requested 1" in error["error"]["message"]
    else:  # LoRAX's error shape
        assert error["error_type"] == "overloaded" and "Limit 2, Used 2" in error["error"]


def test_a_refusal_takes_nothing_and_other_tenants_are_not_held(srv):
    ctx = srv.app.state.ctx
    key, other = srv.make_tenant("capped"), srv.make_tenant("free")
    srv.upload("capped", "sql")
    _patch(srv, "capped", {"max_requests_per_minute": 2})
    body = {"model": "sql", "prompt": "ab", "max_tokens": 1}
    with srv.tenant_client(key) as c:
        assert [c.post("/v1/completions", json=body).status_code for _ in range(2)] == [200, 200]
        started, usage_before = len(srv.engine.started), _usage_requests(srv, "capped")
        metrics_before = _tenant_requests_metric(srv, "capped")
        refused = c.post("/v1/completions", json=body)
    assert refused.status_code == 429
    assert len(srv.engine.started) == started  # no engine request
    assert ctx.limiter.in_flight("capped") == 0  # no tenant slot
    assert all(n == 0 for n in srv.adapters.in_use.values())  # the adapter version was let go
    assert ctx.rate_limiter.used("capped", "requests") == 2  # the refusal took no request
    assert _tenant_requests_metric(srv, "capped") == metrics_before == 2
    assert _usage_requests(srv, "capped") == usage_before == 2
    assert "capped" not in str(ctx.metrics.tenant_states())
    with srv.tenant_client(other) as c:  # another tenant without limits: no headers, no refusal
        answers = [c.post("/v1/completions", json={**body, "model": "fake-model"}) for _ in range(4)]
    assert [r.status_code for r in answers] == [200] * 4
    assert not any(h.startswith("x-ratelimit-") for r in answers for h in r.headers)


def _usage_requests(srv, tenant: str) -> int:
    ctx = srv.app.state.ctx
    assert ctx.usage.flush()
    report = srv.registry.usage_report(tenant=tenant)
    return report.totals.get("requests", 0) + report.totals.get("failed_requests", 0)


def _tenant_requests_metric(srv, tenant: str) -> float:
    with srv.admin() as c:
        text = c.get("/metrics").text
    line = next((ln for ln in text.splitlines() if ln.startswith(f'loraplex_tenant_requests_total{{tenant="{tenant}"}}')),
                None)
    return 0.0 if line is None else float(line.rsplit(" ", 1)[1])


def test_a_changed_limit_applies_to_the_next_request(srv):
    key = srv.make_tenant("live")
    body = {"model": "fake-model", "prompt": "ab", "max_tokens": 1}
    _patch(srv, "live", {"max_requests_per_minute": 5})
    with srv.tenant_client(key) as c:
        assert c.post("/v1/completions", json=body).status_code == 200
        _patch(srv, "live", {"max_requests_per_minute": 1})  # lowered below what was used
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 429 and r.headers["retry-after"] == "60"
        _patch(srv, "live", {"max_requests_per_minute": 3})  # raised: room at once
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.headers["x-ratelimit-remaining-requests"] == "1"
        _patch(srv, "live", {"max_requests_per_minute": None})  # unlimited: no limit, no headers
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200 and "x-ratelimit-limit-requests" not in r.headers


# prompt "ab" is 3 tokens (BOS, a, b); every letter is a stop string, so each completion ends at
# its first token: a request reserving 90 completion tokens uses 1
PROMPT_TOKENS = 3
STOPPING = {"model": "fake-model", "prompt": "ab", "max_tokens": 90, "stop": list(LETTERS.strip())}


def test_a_token_limit_refuses_what_does_not_fit_and_admits_it_after_a_give_back(srv):
    engine, ctx = srv.engine, srv.app.state.ctx
    key = srv.make_tenant("tpm")
    _patch(srv, "tpm", {"max_tokens_per_minute": 100})
    with srv.tenant_client(key) as c, ThreadPoolExecutor(1) as pool:
        engine.gate.clear()
        try:
            before = len(engine.started)
            first = pool.submit(c.post, "/v1/completions", json=STOPPING)  # reserves 3 + 90
            for _ in range(400):
                if len(engine.started) > before:
                    break
                time.sleep(0.01)
            assert ctx.rate_limiter.used("tpm", "tokens") == PROMPT_TOKENS + 90
            second = c.post("/v1/completions", json=STOPPING)  # 93 more: 86 over
        finally:
            engine.gate.set()
        first = first.result()
        assert first.status_code == 200 and first.json()["usage"]["completion_tokens"] == 1
        assert first.headers["x-ratelimit-remaining-tokens"] == str(100 - 93)
        assert first.headers["x-ratelimit-reset-tokens"] == "55.8s"  # 93 tokens at 100 per minute
        assert second.status_code == 429
        assert second.json()["error"]["code"] == "rate_limit_exceeded"
        assert second.json()["error"]["type"] == "tokens"
        assert second.headers["retry-after"] == "52"  # 86 tokens at 100 per minute: 51.6 s
        assert "Limit 100, Used 93, Requested 93" in second.json()["error"]["message"]
        assert not any(h.startswith("x-ratelimit-") and h.endswith("-requests") for h in second.headers)

        # the first has finished with 3 + 1 tokens: 89 came back, so the same request fits now
        assert ctx.rate_limiter.used("tpm", "tokens") == PROMPT_TOKENS + 1
        third = c.post("/v1/completions", json=STOPPING)
        assert third.status_code == 200, third.text
        assert third.headers["x-ratelimit-remaining-tokens"] == str(100 - 4 - 93)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"model": "fake-model", "prompt": "ab", "max_tokens": 49, "n": 2}, "max_tokens"),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "user", "content": "x" * 99}],
                              "max_tokens": 1}, "messages"),
    ("/v1/responses", {"model": "fake-model", "input": "hi", "max_output_tokens": 95}, "max_output_tokens"),
])
def test_a_request_larger_than_the_minute_is_a_400_and_takes_nothing(srv, path, body, param):
    ctx = srv.app.state.ctx
    tenant = f"big{len(srv.registry.list_tenants())}"  # a fresh tenant per case
    key = srv.make_tenant(tenant)
    _patch(srv, tenant, {"max_tokens_per_minute": 100, "max_requests_per_minute": 10})
    started = len(srv.engine.started)
    with srv.tenant_client(key) as c:
        r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("request_too_large", param)
    assert "Limit 100" in error["message"] and "never fit" in error["message"]
    assert "retry-after" not in r.headers
    assert len(srv.engine.started) == started
    assert ctx.rate_limiter.used(tenant, "tokens") == 0 and ctx.rate_limiter.used(tenant, "requests") == 0


def test_headers_of_both_limits_are_consistent_across_requests(srv):
    key = srv.make_tenant("both")
    _patch(srv, "both", {"max_requests_per_minute": 60, "max_tokens_per_minute": 1000})
    body = {**STOPPING, "max_tokens": 10}  # reserves 13, uses 4
    with srv.tenant_client(key) as c:
        one = c.post("/v1/completions", json={**body, "stream": True})
        two = c.post("/v1/completions", json=body)
    for r in (one, two):
        assert all(h in r.headers for h in REQUEST_HEADERS + TOKEN_HEADERS)
        assert r.headers["x-ratelimit-limit-requests"] == "60" and r.headers["x-ratelimit-limit-tokens"] == "1000"
    assert (one.headers["x-ratelimit-remaining-requests"], two.headers["x-ratelimit-remaining-requests"]) == ("59", "58")
    # the first reserved 13 and gave back 9 when it ended; the second reserved 13 more
    assert (one.headers["x-ratelimit-remaining-tokens"], two.headers["x-ratelimit-remaining-tokens"]) == ("987", "983")
    assert (one.headers["x-ratelimit-reset-requests"], two.headers["x-ratelimit-reset-requests"]) == ("1s", "2s")
    assert two.headers["x-ratelimit-reset-tokens"] == "1.02s"  # 17 tokens at 1000 per minute


def test_a_request_the_concurrency_cap_refuses_gets_its_rate_reservation_back(srv):
    engine, ctx = srv.engine, srv.app.state.ctx
    key = srv.make_tenant("capone")
    _patch(srv, "capone", {"max_concurrent_requests": 1, "max_requests_per_minute": 5, "max_tokens_per_minute": 500})
    body = {"model": "fake-model", "prompt": "ab", "max_tokens": 10}
    with srv.tenant_client(key) as c, ThreadPoolExecutor(1) as pool:
        engine.gate.clear()
        try:
            before = len(engine.started)
            first = pool.submit(c.post, "/v1/completions", json=body)
            for _ in range(400):
                if len(engine.started) > before:
                    break
                time.sleep(0.01)
            second = c.post("/v1/completions", json=body)
            held = ctx.rate_limiter.used("capone", "requests"), ctx.rate_limiter.used("capone", "tokens")
        finally:
            engine.gate.set()
        assert first.result().status_code == 200
    assert second.status_code == 429 and "concurrent" in second.json()["error"]["message"]
    assert held == (1, PROMPT_TOKENS + 10)  # only the first request's reservation


def test_chat_without_max_tokens_reserves_at_most_one_minute(srv):
    # it may write all the context leaves (128 - its prompt, more than the limit of 100): it
    # reserves the whole minute instead of being refused, and gives back what it did not use
    ctx = srv.app.state.ctx
    key = srv.make_tenant("open-chat")
    _patch(srv, "open-chat", {"max_tokens_per_minute": 100})
    body = {"model": "fake-model", "messages": CHAT, "stop": list(LETTERS.strip())}
    with srv.tenant_client(key) as c:
        first = c.post("/v1/chat/completions", json=body)
        assert first.status_code == 200, first.text
        assert first.headers["x-ratelimit-remaining-tokens"] == "0"  # the whole minute, at admission
        usage = first.json()["usage"]
        assert ctx.rate_limiter.used("open-chat", "tokens") == usage["prompt_tokens"] + usage["completion_tokens"]
        second = c.post("/v1/chat/completions", json=body)  # needs a whole minute again: not yet
    assert second.status_code == 429 and second.json()["error"]["code"] == "rate_limit_exceeded"
