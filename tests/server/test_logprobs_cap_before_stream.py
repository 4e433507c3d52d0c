"""--max-logprobs is decided before a request reaches the engine, on every route, streamed or
not: a count above the cap (-1: above the vocabulary, vLLM's rule) is a 400 naming the field the
client sent, and no stream starts (a refusal after the 200 would reach an SSE client in-band
only). LoRAX's ``return_k_alternatives`` is bounded by the same cap. References: vLLM's rule as
stated, and the fake tokenizer's vocabulary (``len(FakeTokenizer())``)."""

from __future__ import annotations

import pytest

from tests.server.fakes import FakeTokenizer

VOCAB = len(FakeTokenizer())
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True}
COMPLETION = {"model": "fake-model", "prompt": "ab", "max_tokens": 1}


def refused_before_the_engine(srv, r, field: str) -> None:
    """OpenAI's 400 naming ``field``, no engine request started."""
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["param"] == field
    assert srv.engine.started == []


def lorax_refused(r, field: str) -> None:
    """LoRAX's answer to bad input: 422, ``{"error", "error_type": "validation"}`` naming ``field``."""
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert f"`{field}`" in r.json()["error"] and r.json()["error_type"] == "validation"


@pytest.mark.parametrize("stream", [False, True])
def test_no_cap_refuses_more_than_the_vocabulary_before_the_stream(server_factory, stream):
    srv = server_factory(max_logprobs=-1)
    c = srv.tenant_client(srv.make_tenant("acme"))
    cases = [("/v1/chat/completions", CHAT, "top_logprobs"), ("/v1/completions", COMPLETION, "logprobs")]
    for path, body, field in cases:
        r = c.post(path, json={**body, field: VOCAB + 1, "stream": stream})
        refused_before_the_engine(srv, r, field)
        assert str(VOCAB) in r.json()["error"]["message"]
    r = c.post("/v1/completions", json={**COMPLETION, "prompt_logprobs": VOCAB + 1})
    refused_before_the_engine(srv, r, "prompt_logprobs")
    r = c.post("/v1/chat/completions", json={**CHAT, "top_logprobs": VOCAB, "stream": stream})
    assert r.status_code == 200, r.text  # the whole vocabulary is allowed
    assert srv.engine.params_seen[srv.engine.started[-1][0]].logprobs == VOCAB


@pytest.mark.parametrize("path", ["/generate", "/generate_stream"])
def test_return_k_alternatives_is_bounded_by_max_logprobs(server_factory, path):
    srv = server_factory(max_logprobs=5)
    c = srv.tenant_client(srv.make_tenant("acme"))
    body = {"inputs": "ab", "parameters": {"max_new_tokens": 1}}
    r = c.post(path, json={**body, "parameters": {**body["parameters"], "return_k_alternatives": 6}})
    lorax_refused(r, "return_k_alternatives")
    assert srv.engine.started == []
    r = c.post(path, json={**body, "parameters": {**body["parameters"], "return_k_alternatives": 5}})
    assert r.status_code == 200, r.text
    assert srv.engine.params_seen[srv.engine.started[-1][0]].logprobs == 5


def test_return_k_alternatives_past_20_when_the_cap_allows(server_factory):
    srv = server_factory(max_logprobs=-1)
    c = srv.tenant_client(srv.make_tenant("acme"))
    ask = lambda k: c.post("/generate", json={"inputs": "ab", "parameters": {"max_new_tokens": 1,  # noqa: E731
                                                                               "return_k_alternatives": k}})
    assert ask(25).status_code == 200
    assert srv.engine.params_seen[srv.engine.started[-1][0]].logprobs == 25
    started = len(srv.engine.started)
    lorax_refused(ask(VOCAB + 1), "return_k_alternatives")
    assert len(srv.engine.started) == started
