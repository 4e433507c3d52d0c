"""Usage accounting through the HTTP server (fake engine, real registry): after real requests on
every generating route, the admin usage API's totals equal the sums of the ``usage`` the answers
reported, per tenant and per adapter; filters, grouping, refusals, failed requests, the periodic
flush and the flush at shutdown."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from datetime import timedelta, timezone

import httpx
import pytest

from loraplex.registry.usage import hour_of
from tests.server.fakes import FakeEngine

NEVER = 3600  # usage_flush_seconds: the thread does not flush during a test


def _sse_data(text: str) -> list[dict]:
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and line[5:].strip() != "[DONE]"]


def _call(client: httpx.Client, route: str, model: str, tenant: str) -> tuple[int, int]:
    """One request on ``route``; returns (prompt, completion) tokens as its answer reported them."""
    if route == "completions":
        r = client.post("/v1/completions", json={"model": model, "prompt": "count me in", "max_tokens": 4})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"], r.json()["usage"]["completion_tokens"]
    if route == "chat_stream":
        r = client.post(f"/t/{tenant}/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "hello there, usage"}], "max_tokens": 5,
            "stream": True, "stream_options": {"include_usage": True}})
        assert r.status_code == 200, r.text
        usage = [c["usage"] for c in _sse_data(r.text) if c.get("usage")][-1]
        return usage["prompt_tokens"], usage["completion_tokens"]
    if route == "responses":
        r = client.post("/v1/responses", json={"model": model, "input": "a response please", "max_output_tokens": 3})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens"], r.json()["usage"]["output_tokens"]
    if route == "responses_stream":
        r = client.post("/v1/responses", json={"model": model, "input": "stream it", "max_output_tokens": 6,
                                               "stream": True})
        assert r.status_code == 200, r.text
        usage = _sse_data(r.text)[-1]["response"]["usage"]
        return usage["input_tokens"], usage["output_tokens"]
    adapter = {} if model == "fake-model" else {"adapter_id": model}
    if route == "generate":
        r = client.post("/generate", json={"inputs": "lorax style", "parameters": {
            "max_new_tokens": 7, "details": True, **adapter}})
        assert r.status_code == 200, r.text
        return r.json()["details"]["prompt_tokens"], r.json()["details"]["generated_tokens"]
    assert route == "generate_stream"
    r = client.post("/generate_stream", json={"inputs": "lorax stream", "parameters": {
        "max_new_tokens": 2, "details": True, **adapter}})
    assert r.status_code == 200, r.text
    details = _sse_data(r.text)[-1]["details"]
    return details["prompt_tokens"], details["generated_tokens"]


ROUTES = ("completions", "chat_stream", "responses", "responses_stream", "generate", "generate_stream")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server whose tenants made requests on every route, the base model and an adapter each,
    and ``expected[(tenant, adapter)] = [requests, prompt, completion]`` summed from the answers."""
    from tests.server.conftest import start_server

    srv = start_server(tmp_path_factory.mktemp("usage"), usage_flush_seconds=NEVER)
    keys = {t: srv.make_tenant(t) for t in ("acme", "globex")}
    for tenant in keys:
        srv.upload(tenant, "sql", payload=tenant.encode())
    expected: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0])
    before = time.time()
    for tenant, key in keys.items():
        with srv.tenant_client(key) as client:
            for model, routes in (("fake-model", ROUTES), ("sql", ROUTES if tenant == "acme" else ROUTES[:2])):
                for route in routes:
                    prompt, completion = _call(client, route, model, tenant)
                    row = expected[(tenant, None if model == "fake-model" else "sql")]
                    row[0] += 1
                    row[1] += prompt
                    row[2] += completion
            # refused before running: counts nothing
            assert client.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
            assert client.post("/v1/completions", json={"model": "sql", "prompt": "x", "n": 0}).status_code == 400
    yield srv, dict(expected), (before, time.time())
    srv.stop()


def _get(srv, path: str, **params) -> httpx.Response:
    with srv.admin() as admin:
        return admin.get(path, params=params)


def _counts(rows: list[dict], *keys: str) -> dict:
    return {tuple(r[k] for k in keys): [r["requests"], r["prompt_tokens"], r["completion_tokens"]] for r in rows}


def test_totals_equal_the_usage_the_answers_reported(served):
    srv, expected, _ = served
    body = _get(srv, "/admin/v1/usage", group_by="tenant,adapter").json()
    assert body["object"] == "usage" and body["group_by"] == ["tenant", "adapter"]
    assert _counts(body["data"], "tenant", "adapter") == expected
    assert all(r["failed_requests"] == 0 and r["total_tokens"] == r["prompt_tokens"] + r["completion_tokens"]
               for r in body["data"])
    totals = body["totals"]
    assert [totals["requests"], totals["prompt_tokens"], totals["completion_tokens"]] == [
        sum(v[i] for v in expected.values()) for i in range(3)]
    assert totals["requests"] == 2 * len(ROUTES) + len(ROUTES) + 2  # the refusals are not in it

    by_tenant = _get(srv, "/admin/v1/usage", group_by="tenant").json()["data"]
    for tenant in ("acme", "globex"):
        want = [sum(v[i] for (t, _), v in expected.items() if t == tenant) for i in range(3)]
        assert _counts(by_tenant, "tenant")[(tenant,)] == want
    shortcut = _get(srv, "/admin/v1/tenants/acme/usage", group_by="adapter").json()
    assert _counts(shortcut["data"], "adapter") == {(a,): v for (t, a), v in expected.items() if t == "acme"}
    sql = _get(srv, "/admin/v1/usage", adapter="sql").json()["totals"]
    assert sql["requests"] == expected[("acme", "sql")][0] + expected[("globex", "sql")][0]


def test_periods_and_time_grouping(served):
    srv, expected, (before, after) = served
    first, last = hour_of(before), hour_of(after)
    iso = lambda h: h.isoformat().replace("+00:00", "Z")  # noqa: E731
    everything = sum(v[0] for v in expected.values())
    assert _get(srv, "/admin/v1/usage", start=iso(first)).json()["totals"]["requests"] == everything
    assert _get(srv, "/admin/v1/usage", end=iso(first)).json()["totals"]["requests"] == 0  # end is exclusive
    assert _get(srv, "/admin/v1/usage", start=iso(last + timedelta(hours=1))).json()["data"] == []
    hours = _get(srv, "/admin/v1/usage", group_by="hour", tenant="acme").json()["data"]
    assert {r["hour"] for r in hours} <= {iso(first), iso(last)}
    assert sum(r["requests"] for r in hours) == sum(v[0] for (t, _), v in expected.items() if t == "acme")
    days = _get(srv, "/admin/v1/usage", group_by="day,tenant").json()["data"]
    assert {r["day"] for r in days} <= {first.date().isoformat(), last.date().isoformat()}
    assert sum(r["requests"] for r in days) == everything
    offset = first.astimezone(timezone(timedelta(hours=2))).isoformat()  # the same hour, another zone
    assert _get(srv, "/admin/v1/usage", start=offset).json()["totals"]["requests"] == everything


@pytest.mark.parametrize("params, param", [
    ({"start": "last tuesday"}, "start"),
    ({"end": "2026-12-03T14:30:00Z"}, "end"),
    ({"start": ""}, "start"),
    ({"start": "2026-12-03T15Z", "end": "2026-12-03T14Z"}, "end"),
    ({"group_by": "tenant,week"}, "group_by"),
    ({"group_by": "hour,day"}, "group_by"),
    ({"tenant": "Not/A/Name"}, "tenant"),
    ({"adapter": ""}, "adapter"),
    ({"tenant": ["acme", "globex"]}, "tenant"),
])
def test_bad_parameters_are_400s_naming_the_param(served, params, param):
    srv, _, _ = served
    before = _get(srv, "/admin/v1/usage", group_by="tenant,adapter").json()
    r = _get(srv, "/admin/v1/usage", **params)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    assert _get(srv, "/admin/v1/usage", group_by="tenant,adapter").json() == before


def test_shortcut_refusals_and_admin_key(served):
    srv, _, _ = served
    r = _get(srv, "/admin/v1/tenants/nobody/usage")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = _get(srv, "/admin/v1/tenants/acme/usage", tenant="globex")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tenant"
    assert httpx.get(srv.url + "/admin/v1/usage").status_code == 401
    tenant_key = srv.make_tenant("nosy")
    with srv.tenant_client(tenant_key) as client:
        assert client.get("/admin/v1/usage").status_code == 401


def test_a_request_cut_short_counts_as_failed_with_what_it_used(server_factory):
    srv = server_factory(FakeEngine(step_seconds=0.02, max_model_len=4096), usage_flush_seconds=NEVER)
    key = srv.make_tenant("acme")
    with srv.tenant_client(key) as client:
        with client.stream("POST", "/v1/completions", json={"model": "fake-model", "prompt": "go on", "max_tokens": 500,
                                                            "stream": True}) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(4)]  # a few chunks, then hang up
    assert all(line.startswith("data:") or not line for line in got)
    deadline = time.monotonic() + 10
    row = {}
    while time.monotonic() < deadline and not row.get("failed_requests"):
        row = _get(srv, "/admin/v1/tenants/acme/usage").json()["totals"]
        time.sleep(0.05)
    prompt = len(srv.engine.tokenizer("go on")["input_ids"])
    assert (row["requests"], row["failed_requests"], row["failed_prompt_tokens"]) == (0, 1, prompt)
    assert 1 <= row["failed_completion_tokens"] < 500 and row["completion_tokens"] == 0


def test_the_thread_flushes_on_its_interval_and_stop_flushes_the_rest(server_factory):
    periodic = server_factory(usage_flush_seconds=0.2)
    key = periodic.make_tenant("acme")
    with periodic.tenant_client(key) as client:
        prompt, completion = _call(client, "completions", "fake-model", "acme")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not periodic.registry.usage_report().rows:  # the database, not the API
        time.sleep(0.05)
    assert periodic.registry.usage_report().totals["prompt_tokens"] == prompt
    stats = _get(periodic, "/admin/v1/status").json()["usage_accounting"]
    assert stats["flush_seconds"] == 0.2 and stats["flushes"] >= 1 and stats["failed_flushes"] == 0

    at_stop = server_factory(usage_flush_seconds=NEVER)
    key = at_stop.make_tenant("acme")
    with at_stop.tenant_client(key) as client:
        prompt, completion = _call(client, "generate", "fake-model", "acme")
    time.sleep(0.3)
    assert at_stop.registry.usage_report().rows == []  # summed in memory only
    at_stop.stop()
    totals = at_stop.registry.usage_report(tenant="acme").totals
    assert (totals["requests"], totals["prompt_tokens"], totals["completion_tokens"]) == (1, prompt, completion)


def test_zero_interval_turns_accounting_off(server_factory):
    srv = server_factory(usage_flush_seconds=0)
    key = srv.make_tenant("acme")
    with srv.tenant_client(key) as client:
        _call(client, "completions", "fake-model", "acme")
    assert srv.app.state.ctx.usage is None
    assert _get(srv, "/admin/v1/usage").json()["totals"]["requests"] == 0
    assert _get(srv, "/admin/v1/status").json()["usage_accounting"] is None
    srv.stop()
    assert srv.registry.usage_report().rows == []
