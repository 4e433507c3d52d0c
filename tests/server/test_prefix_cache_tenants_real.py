"""The default prefix-cache scope keeps tenants apart on a real (tiny) engine, through every
generating route: OpenAI completions (n > 1 too) and chat, LoRAX's /generate and the Responses
API. The same prompt sent again by the same tenant hits the cache; sent by another tenant, or
with another ``cache_salt``, it hits nothing (the engine's prefix-cache hit counter)."""

from __future__ import annotations

import pytest

from loraplex.engine.async_engine import AsyncLLMEngine
from tests.engine.test_engine_exact import tight_llm
from tests.server.conftest import start_server

TEXT = " ".join(f"word{i}" for i in range(40))  # several full blocks of 16 tokens


@pytest.fixture(scope="module")
def world(tiny_llama_dir, tmp_path_factory):
    llm = tight_llm(tiny_llama_dir, tmp_path_factory.mktemp("home"), num_blocks=256, enable_prefix_caching=True,
                    max_num_batched_tokens=512)
    engine = AsyncLLMEngine(llm.config, engine=llm.engine)
    srv = start_server(tmp_path_factory.mktemp("pc"), engine)
    keys = {t: srv.make_tenant(t) for t in ("alice", "bob")}
    yield srv, llm.engine, keys
    srv.stop()
    engine.shutdown()


def _hits(engine) -> int:
    return engine.stats()["prefix_cache_hits"]


def _bodies(model: str, salt: str | None):
    extra = {} if salt is None else {"cache_salt": salt}
    return [  # each its own text: no two routes' prompts share a leading block
        ("/v1/completions", {"model": model, "prompt": "c " + TEXT, "max_tokens": 2, **extra}),
        ("/v1/completions", {"model": model, "prompt": "n " + TEXT, "max_tokens": 2, "n": 2, "temperature": 1.0,
                             **extra}),
        ("/v1/chat/completions", {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": TEXT}],
                                  **extra}),
        ("/generate", {"inputs": "g " + TEXT, "parameters": {"max_new_tokens": 2}}),
        ("/v1/responses", {"model": model, "input": "r " + TEXT, "max_output_tokens": 2, **extra}),
    ]


@pytest.mark.parametrize("index", range(5))
def test_a_tenant_hits_only_its_own_blocks(world, index):
    srv, engine, keys = world
    model = srv.app.state.ctx.served_model_name
    path, body = _bodies(model, None)[index]

    def send(tenant: str, salt_body: dict = body) -> int:
        before = _hits(engine)
        with srv.tenant_client(keys[tenant]) as c:
            r = c.post(path, json=salt_body)
        assert r.status_code == 200, r.text
        return _hits(engine) - before

    first = send("alice")  # cold: only n > 1's sequences share within the request
    assert (first > 0) == (body.get("n", 1) > 1)
    assert send("alice") > first  # its own prompt again: cached
    assert send("bob") == first  # the same prompt from another tenant: nothing shared
    assert send("bob") > first
    if path != "/generate":  # a salt narrows a tenant's scope further
        salted = _bodies(model, "s1")[index][1]
        assert send("alice", salted) == first and send("alice", salted) > first
    assert engine.stats()["num_unfinished_requests"] == 0
