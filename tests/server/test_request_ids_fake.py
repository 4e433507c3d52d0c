"""``x-request-id`` on every response, over HTTP (a real uvicorn server, the fake engine).

The contract is OpenAI's: the header names the request, and for a generation it is the
response's own ``id`` (the openai client reads the header as ``response._request_id``), so the
header and the body agree, streamed or not. Any other answer (admin, tokenizer, health, every
error in OpenAI's envelope, the body-size middleware's 413, Starlette's own 500) carries a fresh
id, a different one per request."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.server.fakes import FakeEngine

FRESH_ID = re.compile(r"req_[0-9a-f]{32}")
MODEL = "fake-model"


@pytest.fixture(scope="module")
def tenant(module_server):
    key = module_server.make_tenant("rid")
    with module_server.tenant_client(key) as client:
        yield module_server, client


def _sse_data(text: str) -> list[dict]:
    return [json.loads(line[5:]) for line in text.splitlines()
            if line.startswith("data:") and line[5:].strip() != "[DONE]"]


GENERATIONS = {  # path, body, how the body names the response
    "completion": ("/v1/completions", {"prompt": "hello", "max_tokens": 3}, "cmpl-"),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, "chatcmpl-"),
    "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 3}, "resp_"),
}


@pytest.mark.parametrize("kind", list(GENERATIONS))
def test_a_whole_answer_is_named_by_its_body_id(tenant, kind):
    _, client = tenant
    path, body, prefix = GENERATIONS[kind]
    r = client.post(path, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == r.json()["id"] and r.json()["id"].startswith(prefix)
    assert r.headers.get_list("x-request-id") == [r.json()["id"]]  # one header, not two


@pytest.mark.parametrize("kind", list(GENERATIONS))
def test_a_stream_is_named_before_its_first_event_by_the_id_its_events_carry(tenant, kind):
    _, client = tenant
    path, body, prefix = GENERATIONS[kind]
    with client.stream("POST", path, json={"model": MODEL, **body, "stream": True}) as r:
        assert r.status_code == 200
        header = r.headers["x-request-id"]  # before any of the body is read
        events = _sse_data(r.read().decode())
    if kind == "responses":
        ids = {e["response"]["id"] for e in events if "response" in e}
    else:
        ids = {e["id"] for e in events}
    assert ids == {header} and header.startswith(prefix)


def test_lorax_generate_is_named_by_its_run_whole_and_streamed(tenant):
    _, client = tenant
    whole = client.post("/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 2}})
    streamed = client.post("/generate_stream", json={"inputs": "hello", "parameters": {"max_new_tokens": 2}})
    assert whole.status_code == streamed.status_code == 200
    ids = [whole.headers["x-request-id"], streamed.headers["x-request-id"]]
    assert all(i.startswith("gen-") for i in ids) and ids[0] != ids[1]


def test_non_generation_routes_get_a_fresh_id_each(tenant):
    srv, client = tenant
    answers = [
        client.get("/v1/models"),
        client.post("/tokenize", json={"model": MODEL, "prompt": "hello"}),
        httpx.get(srv.url + "/health"),
        httpx.get(srv.url + "/metrics"),
        httpx.get(srv.url + "/admin/"),  # the admin UI's static files
    ]
    with srv.admin() as admin:
        answers += [admin.get("/admin/v1/tenants"), admin.get("/admin/v1/status")]
    assert [r.status_code for r in answers] == [200] * len(answers)
    ids = [r.headers["x-request-id"] for r in answers]
    assert all(FRESH_ID.fullmatch(i) for i in ids), ids
    assert len(set(ids)) == len(ids)


def _is_openai_error(r: httpx.Response, status: int) -> bool:
    body = r.json()
    return r.status_code == status and set(body["error"]) == {"message", "type", "param", "code"}


def test_errors_carry_a_fresh_id(tenant):
    srv, client = tenant
    no_key = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    no_model = client.post("/v1/completions", json={"model": "missing", "prompt": "x"})
    bad_field = client.post("/v1/chat/completions", json={"model": MODEL, "messages": "not a list"})
    no_route = client.get("/v1/nowhere")
    admin_no_key = httpx.get(srv.url + "/admin/v1/tenants")
    assert _is_openai_error(no_key, 401) and _is_openai_error(admin_no_key, 401)
    assert _is_openai_error(no_model, 404) and _is_openai_error(no_route, 404)
    assert _is_openai_error(bad_field, 400)
    ids = [r.headers["x-request-id"] for r in (no_key, no_model, bad_field, no_route, admin_no_key)]
    assert all(FRESH_ID.fullmatch(i) for i in ids) and len(set(ids)) == len(ids)


def test_the_body_size_middlewares_413_carries_an_id(server_factory):
    srv = server_factory(max_body_bytes=1000)
    key = srv.make_tenant("big")
    big = {"model": MODEL, "prompt": "x" * 2000}
    with srv.tenant_client(key) as client:
        declared = client.post("/v1/completions", json=big)  # refused by the middleware on content-length

        def chunked():  # no content-length: refused while the route reads
            yield json.dumps(big).encode()

        counted = client.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    for r in (declared, counted):
        assert _is_openai_error(r, 413) and FRESH_ID.fullmatch(r.headers["x-request-id"])


def test_a_429_carries_an_id(server_factory):
    srv = server_factory(FakeEngine(step_seconds=0.02), max_concurrent_requests_per_tenant=1)
    key = srv.make_tenant("busy")
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 50, "stream": True}
    with srv.tenant_client(key) as client, client.stream("POST", "/v1/completions", json=body) as held:
        lines = held.iter_lines()  # kept: a dropped iterator closes the stream
        assert next(lines).startswith("data:")  # admitted and running
        refused = client.post("/v1/completions", json={**body, "stream": False})
        assert _is_openai_error(refused, 429) and FRESH_ID.fullmatch(refused.headers["x-request-id"])
        assert held.headers["x-request-id"].startswith("cmpl-")


def test_an_unexpected_exception_is_a_500_with_an_id(server_factory):
    """Starlette answers it from its outermost middleware, past the request-id one."""
    srv = server_factory()
    key = srv.make_tenant("boom")

    def broken(tenant):
        raise RuntimeError("registry exploded")

    srv.registry.list_adapters = broken
    with srv.tenant_client(key) as client:
        r = client.get("/v1/models", headers={"X-Request-Id": "client-500"})
    assert _is_openai_error(r, 500) and FRESH_ID.fullmatch(r.headers["x-request-id"])
    assert r.headers.get_list("x-request-id") == [r.headers["x-request-id"]]
    assert r.headers["x-client-request-id"] == "client-500"
