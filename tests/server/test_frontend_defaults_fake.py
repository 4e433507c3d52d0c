"""vLLM's --response-role, --return-tokens-as-token-ids and --max-logprobs over HTTP (fake
engine). References: vLLM's rules, stated here (the role is the server's when the prompt asks for
a reply, else the continued message's; a request's own token-id field wins; a count over the cap
is a 400 naming the field), and the fake engine's tokens from ``fake_token``."""

from __future__ import annotations

import json

import pytest

from tests.server.fakes import FakeTokenizer, fake_token

USER = [{"role": "user", "content": "hi"}]


def events(text: str) -> list[dict]:
    return [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]


@pytest.fixture
def tenant(server_factory):
    def make(**settings):
        srv = server_factory(**settings)
        return srv, srv.tenant_client(srv.make_tenant("acme"))
    return make


def test_response_role_names_chat_answers_streamed_or_not(tenant):
    srv, c = tenant(response_role="bot")
    body = {"model": "fake-model", "messages": USER, "max_tokens": 2}
    assert c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["role"] == "bot"
    chunks = events(c.post("/v1/chat/completions", json={**body, "stream": True}).text)
    roles = [ch["choices"][0]["delta"].get("role") for ch in chunks if ch["choices"]]
    assert roles[0] == "bot" and set(roles[1:]) <= {None}  # announced once, first
    # no generation prompt: the answer continues the last message, under its role (vLLM's rule)
    cont = {**body, "messages": [*USER, {"role": "assistant", "content": "so"}], "add_generation_prompt": False}
    assert c.post("/v1/chat/completions", json=cont).json()["choices"][0]["message"]["role"] == "assistant"
    cont["messages"] = USER
    assert c.post("/v1/chat/completions", json=cont).json()["choices"][0]["message"]["role"] == "user"


def test_default_role_is_assistant(tenant):
    _, c = tenant()
    r = c.post("/v1/chat/completions", json={"model": "fake-model", "messages": USER, "max_tokens": 1})
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_server_wide_token_ids_and_a_request_that_says_no(tenant):
    _, c = tenant(return_tokens_as_token_ids=True)
    prompt_ids = FakeTokenizer()("ab")["input_ids"]
    ids = [fake_token(prompt_ids, None, 4, 0, k) for k in range(3)]
    body = {"model": "fake-model", "prompt": "ab", "max_tokens": 3, "logprobs": 1, "seed": 4}
    tokens = c.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"]
    assert tokens == [f"token_id:{i}" for i in ids]
    tokens = c.post("/v1/completions", json={**body, "return_tokens_as_token_ids": False}).json()
    assert tokens["choices"][0]["logprobs"]["tokens"] == [FakeTokenizer().decode([i]) for i in ids]


@pytest.mark.parametrize("cap", [5, 30])
def test_max_logprobs_bounds_every_logprobs_field(tenant, cap):
    srv, c = tenant(max_logprobs=cap)
    chat = {"model": "fake-model", "messages": USER, "max_tokens": 1, "logprobs": True}
    completion = {"model": "fake-model", "prompt": "ab", "max_tokens": 1}
    asks = [("/v1/chat/completions", chat, "top_logprobs"), ("/v1/completions", completion, "logprobs"),
            ("/v1/completions", completion, "prompt_logprobs")]
    for path, body, field in asks:
        r = c.post(path, json={**body, field: cap + 1})
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["param"] == field
        assert f"<= {cap}" in r.json()["error"]["message"]
        before = len(srv.engine.started)
        assert c.post(path, json={**body, field: cap}).status_code == 200, field
        assert len(srv.engine.started) == before + 1
        params = srv.engine.params_seen[srv.engine.started[-1][0]]
        wanted = params.prompt_logprobs if field == "prompt_logprobs" else params.logprobs
        assert wanted == cap  # what the engine was asked, past OpenAI's 20 when the cap is higher


def test_no_cap_allows_up_to_the_vocabulary(tenant):
    srv, c = tenant(max_logprobs=-1)
    vocab = len(FakeTokenizer())  # past 20; one more is refused (test_logprobs_cap_before_stream.py)
    r = c.post("/v1/completions", json={"model": "fake-model", "prompt": "ab", "max_tokens": 1, "logprobs": vocab})
    assert r.status_code == 200
    assert srv.engine.params_seen[srv.engine.started[-1][0]].logprobs == vocab
