"""Every error case of the tenant API: status, OpenAI envelope, and `param` naming the field."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.server.fakes import FakeEngine


def _upload(srv, tenant, name, payload=b"w"):
    srv.upload(tenant, name, payload, config=b"{}")


def _envelope(r: httpx.Response, status: int, code=None, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    return err


@pytest.fixture(scope="module")
def tenants(module_server):
    acme = module_server.make_tenant("acme")
    globex = module_server.make_tenant("globex")
    _upload(module_server, "acme", "sql")
    _upload(module_server, "globex", "private")
    return module_server, acme, globex


def test_auth_required_and_tenant_bound(tenants):
    srv, acme, globex = tenants
    body = {"model": "sql", "prompt": "x", "max_tokens": 1}
    before = len(srv.engine.started)
    with httpx.Client(base_url=srv.url) as c:
        _envelope(c.post("/t/acme/v1/completions", json=body), 401, "invalid_api_key")
        _envelope(c.post("/t/acme/v1/completions", json=body, headers={"Authorization": "Bearer nope"}), 401)
        # a valid key of another tenant is not a key for this one
        _envelope(c.post("/t/acme/v1/completions", json=body, headers={"Authorization": f"Bearer {globex}"}), 401)
        _envelope(c.get("/t/acme/v1/models", headers={"Authorization": f"Bearer {globex}"}), 401)
        # admin key is not a tenant key, and a tenant key is not the admin key
        _envelope(c.post("/v1/completions", json=body, headers={"Authorization": "Bearer test-admin-key"}), 401)
        _envelope(c.get("/admin/v1/tenants", headers={"Authorization": f"Bearer {acme}"}), 401)
    assert len(srv.engine.started) == before  # nothing reached the engine


def test_other_tenants_adapter_is_indistinguishable_from_missing(tenants):
    srv, acme, globex = tenants
    with srv.tenant_client(acme) as c:
        foreign = c.post("/t/acme/v1/completions", json={"model": "private", "prompt": "x"})
        missing = c.post("/t/acme/v1/completions", json={"model": "nothing", "prompt": "x"})
        bad_version = c.post("/t/acme/v1/completions", json={"model": "sql@9", "prompt": "x"})
    a = _envelope(foreign, 404, "model_not_found", "model")
    b = _envelope(missing, 404, "model_not_found", "model")
    _envelope(bad_version, 404, "model_not_found", "model")
    assert a["message"].replace("private", "X") == b["message"].replace("nothing", "X")
    assert a["type"] == b["type"]


@pytest.mark.parametrize(
    "patch,param",
    [
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": True}, "n"),
        ({"stop": 3}, "stop"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 2**63}, "seed"),  # vLLM: a 64-bit signed integer (the sampler keeps 64 bits: 2**64 was 0)
        ({"seed": -(2**63) - 1}, "seed"),
        ({"max_tokens": -1, "echo": True}, "max_tokens"),  # only 0 means "echo the prompt, no completion"
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logprobs": 50}, "logprobs"),
        ({"top_k": "a"}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 10**400}, "repetition_penalty"),  # no float holds it: was a 500
        ({"logit_bias": {"5": 10**400}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"model": 3}, "model"),
        ({"user": 5}, "user"),  # OpenAI's and vLLM's type check (it was dropped silently)
    ],
)
def test_completion_validation(tenants, patch, param):
    srv, acme, _ = tenants
    body = {"model": "sql", "prompt": "hello", "max_tokens": 3, **patch}
    with srv.tenant_client(acme) as c:
        _envelope(c.post("/v1/completions", json=body), 400, param=param)


@pytest.mark.parametrize("field,literal", [("temperature", "NaN"), ("top_p", "NaN"), ("presence_penalty", "Infinity"),
                                           ("frequency_penalty", "-Infinity")])
def test_a_number_that_is_not_finite_is_named(tenants, field, literal):
    """The body's parser reads NaN and Infinity literals (as Python's json does); NaN passes
    every range comparison, so a NaN temperature reached the engine, whose message named
    another bound."""
    srv, acme, _ = tenants
    body = f'{{"model": "sql", "prompt": "x", "{field}": {literal}}}'.encode()
    with srv.tenant_client(acme) as c:
        r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    err = _envelope(r, 400, param=field)
    assert err["message"].startswith(f"`{field}` must be a finite number"), err


def test_seeds_at_the_64_bit_bounds_are_taken(tenants):
    srv, acme, _ = tenants
    with srv.tenant_client(acme) as c:
        for seed in (2**63 - 1, -(2**63)):
            r = c.post("/v1/completions", json={"model": "sql", "prompt": "hello", "max_tokens": 2, "seed": seed})
            assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "patch,param",
    [
        ({"messages": []}, "messages"),
        ({"seed": 2**63}, "seed"),
        ({"max_tokens": 0, "echo": True}, "echo"),  # echo is completions' only
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"user": ["a"]}, "user"),
    ],
)
def test_chat_validation(tenants, patch, param):
    srv, acme, _ = tenants
    body = {"model": "sql", "messages": [{"role": "user", "content": "hi"}], **patch}
    with srv.tenant_client(acme) as c:
        _envelope(c.post("/v1/chat/completions", json=body), 400, param=param)


def test_unknown_fields_ignored_and_bad_json(tenants):
    srv, acme, _ = tenants
    with srv.tenant_client(acme) as c:
        ok = c.post("/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": 1, "frobnicate": {"a": 1}})
        assert ok.status_code == 200
        _envelope(c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)


def test_context_length_and_prompt_limits(server_factory):
    srv = server_factory(FakeEngine(max_model_len=32), max_prompt_tokens=20, max_n=2)
    key = srv.make_tenant("acme")
    with srv.tenant_client(key) as c:
        _envelope(c.post("/v1/completions", json={"model": "fake-model", "prompt": "a" * 25}), 400,
                  "context_length_exceeded", "prompt")
        _envelope(c.post("/v1/completions", json={"model": "fake-model", "prompt": "a" * 10, "max_tokens": 30}), 400,
                  "context_length_exceeded", "max_tokens")
        _envelope(c.post("/v1/completions", json={"model": "fake-model", "prompt": "ab", "n": 3}), 400, param="n")
        # chat without max_tokens: whatever the context leaves
        r = c.post("/v1/chat/completions", json={"model": "fake-model", "messages": [{"role": "user", "content": "ab"}]})
        assert r.status_code == 200
        assert r.json()["usage"]["total_tokens"] == 32


def test_body_too_large(server_factory):
    srv = server_factory(max_body_bytes=1000)
    key = srv.make_tenant("acme")
    with srv.tenant_client(key) as c:
        _envelope(c.post("/v1/completions", json={"model": "fake-model", "prompt": "a" * 5000}), 413)

        def chunks():  # no content-length: counted while read
            yield b'{"model": "fake-model", "prompt": "'
            for _ in range(20):
                yield b"a" * 100
            yield b'"}'

        _envelope(c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)


def test_concurrency_limit_per_tenant(server_factory):
    engine = FakeEngine(step_seconds=0.05)
    srv = server_factory(engine, max_concurrent_requests_per_tenant=2)
    acme = srv.make_tenant("acme")
    globex = srv.make_tenant("globex")

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, timeout=20) as c:
            body = {"model": "fake-model", "prompt": "ab", "max_tokens": 40}  # 2 s in flight each
            h = lambda k: {"Authorization": f"Bearer {k}"}  # noqa: E731
            slow = [asyncio.create_task(c.post("/v1/completions", json=body, headers=h(acme))) for _ in range(2)]
            for _ in range(400):  # until both run (a fixed sleep raced a loaded machine)
                if len(engine.started) == 2:
                    break
                await asyncio.sleep(0.025)
            refused = await c.post("/v1/completions", json=body, headers=h(acme))
            other = await c.post("/v1/completions", json={**body, "max_tokens": 1}, headers=h(globex))
            return [await t for t in slow], refused, other

    slow, refused, other = asyncio.run(run())
    assert [r.status_code for r in slow] == [200, 200]
    _envelope(refused, 429, "rate_limit_exceeded")
    assert int(refused.headers["retry-after"]) >= 1
    assert other.status_code == 200  # another tenant is not limited by acme's load


def test_unknown_route_and_method(tenants):
    srv, acme, _ = tenants
    with srv.tenant_client(acme) as c:
        _envelope(c.get("/v1/nothing"), 404)
        _envelope(c.get("/v1/completions"), 405)


def test_whole_number_floats_are_integers_and_0_or_1_booleans(tenants):
    """vLLM's request models (pydantic, lax) take ``max_tokens=4.0`` (Python's ``budget / 2``) as
    4 and chat's ``logprobs: 1`` as true; loraplex answered 400. A fractional value stays a 400."""
    srv, acme, _ = tenants
    with srv.tenant_client(acme) as c:
        r = c.post("/t/acme/v1/chat/completions", json={
            "model": "sql", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4.0, "n": 2.0,
            "seed": 3.0, "logprobs": 1, "top_logprobs": 2.0})
        assert r.status_code == 200, r.text
        params = list(srv.engine.params_seen.values())[-1]
        assert (params.max_tokens, params.n, params.seed) == (4, 2, 3)
        assert all(type(v) is int for v in (params.max_tokens, params.n, params.seed))
        body = r.json()
        assert len(body["choices"]) == 2 and all(len(ch["logprobs"]["content"]) == 4 for ch in body["choices"])
        r = c.post("/t/acme/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": 3.0, "logprobs": 1.0})
        assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["tokens"]) == 3
        for patch, param in (({"max_tokens": 4.5}, "max_tokens"), ({"logprobs": 2}, "logprobs"),
                             ({"max_tokens": float("inf")}, "max_tokens")):
            body = {"model": "sql", "messages": [{"role": "user", "content": "x"}], **patch}
            _envelope(c.post("/t/acme/v1/chat/completions", content=json.dumps(body),
                             headers={"content-type": "application/json"}), 400, param=param)
