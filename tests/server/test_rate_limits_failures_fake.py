"""Requests of a tenant with rate limits that fail after admission (the engine refuses the
adapter at load time, on the first token): the error answer still carries OpenAI's
x-ratelimit-* headers, as every answer of such a tenant does; the unused max_tokens come back
to the token bucket; usage counts one failed request and no answered one."""

from __future__ import annotations

import time

import pytest

from loraplex.lora.errors import InvalidAdapterError
from tests.server.conftest import start_server
from tests.server.fakes import FakeEngine

RATE_HEADERS = {f"x-ratelimit-{what}-{kind}" for what in ("limit", "remaining", "reset")
                for kind in ("requests", "tokens")}
BAD = "zz"  # a prompt the engine refuses, as it refuses an adapter whose weights do not load


class RefusingEngine(FakeEngine):
    async def generate(self, prompt, params, *args, **kwargs):
        if prompt == self.tokenizer(BAD)["input_ids"]:
            raise InvalidAdapterError("adapter weights do not fit the base model", param="model")
        async for out in super().generate(prompt, params, *args, **kwargs):
            yield out


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("ratefail"), RefusingEngine(), usage_flush_seconds=3600)
    frozen = time.monotonic()
    server.app.state.ctx.rate_limiter.clock = lambda: frozen  # nothing refills during a test
    yield server
    server.stop()


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "fake-model", "prompt": BAD, "max_tokens": 20}),
    ("/generate", {"inputs": BAD, "parameters": {"max_new_tokens": 20}}),
])
def test_an_error_after_admission_carries_the_headers_and_gives_back(srv, path, body):
    ctx = srv.app.state.ctx
    tenant = f"fail{len(srv.registry.list_tenants())}"
    key = srv.make_tenant(tenant)
    with srv.admin() as c:
        assert c.patch(f"/admin/v1/tenants/{tenant}", json={"max_requests_per_minute": 10,
                                                            "max_tokens_per_minute": 1000}).status_code == 200
    with srv.tenant_client(key) as c:
        r = c.post(path, json=body)
    assert r.status_code in (400, 422), r.text
    assert "do not fit the base model" in r.text
    assert RATE_HEADERS <= set(r.headers), dict(r.headers)
    assert r.headers["x-ratelimit-remaining-requests"] == "9"
    prompt = len(ctx.tokenizer(BAD)["input_ids"])
    assert r.headers["x-ratelimit-remaining-tokens"] == str(1000 - prompt - 20)  # as of admission
    assert ctx.rate_limiter.used(tenant, "tokens") == prompt  # the 20 unused came back
    assert ctx.usage.flush()
    totals = srv.registry.usage_report(tenant=tenant).totals
    assert (totals["requests"], totals["failed_requests"], totals["failed_prompt_tokens"]) == (0, 1, prompt)
