"""Fields that change the output: ``logit_bias`` is checked and passed on (structured output:
test_structured_fields_fake.py); fields loraplex does not implement are refused with a 400
naming them (never silently ignored); harmless ones pass. vLLM's prompt-side fields, once refused
here, are served: test_prompt_fields_fake.py."""

from __future__ import annotations

import pytest

from tests.server.test_errors_fake import _envelope

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "fake-model", "prompt": "hello", "max_tokens": 2}
ENDPOINTS = {"chat": ("/v1/chat/completions", CHAT), "completion": ("/v1/completions", COMPLETION)}
FAKE_VOCAB = 34  # len(FakeTokenizer())


@pytest.fixture(scope="module")
def client(module_server):
    key = module_server.make_tenant("refuser")
    with module_server.tenant_client(key) as c:
        yield module_server, c


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize(
    "bias",
    [[1, 2], "5", {"abc": 1}, {"-1": 1}, {"1.5": 1}, {" 5": 1}, {"5": "x"}, {"5": True}, {"5": None},
     {"5": 100.5}, {"5": -101}, {str(FAKE_VOCAB): 1}, {"99999999": -5}],
)
def test_logit_bias_refused(client, kind, bias):
    srv, c = client
    path, body = ENDPOINTS[kind]
    for stream in (False, True):  # a stream is refused before it starts, not in-band
        err = _envelope(c.post(path, json={**body, "logit_bias": bias, "stream": stream}), 400, param="logit_bias")
    if bias == {str(FAKE_VOCAB): 1}:
        assert str(FAKE_VOCAB) in err["message"]


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_logit_bias_reaches_the_engine(client, kind):
    srv, c = client
    path, body = ENDPOINTS[kind]
    r = c.post(path, json={**body, "logit_bias": {"5": 10, "33": -100, "7": 0.5}})
    assert r.status_code == 200, r.text
    rid = srv.engine.started[-1][0]
    assert srv.engine.params_seen[rid].logit_bias == {5: 10.0, 33: -100.0, 7: 0.5}
    r = c.post(path, json={**body, "logit_bias": {}})
    assert r.status_code == 200 and srv.engine.params_seen[srv.engine.started[-1][0]].logit_bias is None


REFUSED = [
    # "auto" tool choice (the default with tools) needs a model-specific parser; "none",
    # "required" and named choices are served (test_tool_calls_fake.py)
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, "tool_choice"),
    ("chat", {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ("chat", {"function_call": {"name": "f"}}, "function_call"),
    ("completion", {"suffix": "tail"}, "suffix"),
    ("both", {"best_of": 3}, "best_of"),
    ("both", {"best_of": 2, "n": 1}, "best_of"),
    # beam search is served (test_beam_search_http_real.py), not with what it would not apply
    ("both", {"use_beam_search": True, "stop": ["x"]}, "stop"),
    ("chat", {"echo": True}, "echo"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
]


def _cases(table):
    for kinds, patch, param in table:
        for kind in (("chat", "completion") if kinds == "both" else (kinds,)):
            yield pytest.param(kind, patch, param, id=f"{kind}-{param}-{len(str(patch))}")


@pytest.mark.parametrize("kind,patch,param", list(_cases(REFUSED)))
def test_unimplemented_fields_refused(client, kind, patch, param):
    srv, c = client
    path, body = ENDPOINTS[kind]
    before = len(srv.engine.started)
    err = _envelope(c.post(path, json={**body, **patch}), 400, code="unsupported_parameter", param=param)
    assert "not supported" in err["message"]
    assert len(srv.engine.started) == before  # nothing reached the engine


ACCEPTED = [
    ("both", {"response_format": {"type": "text"}}),
    ("both", {"response_format": None}),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ("chat", {"tools": [], "tool_choice": "auto"}),
    ("chat", {"tool_choice": "none", "parallel_tool_calls": False}),
    ("chat", {"functions": [{"name": "f"}], "function_call": "none"}),
    ("completion", {"suffix": ""}),
    ("completion", {"suffix": None}),
    ("both", {"best_of": 2, "n": 2}),
    ("both", {"best_of": 1}),
    ("both", {"best_of": None}),
    ("both", {"prompt_logprobs": None, "guided_json": None, "structured_outputs": None}),
    ("both", {"use_beam_search": False, "bad_words": [], "return_tokens_as_token_ids": False}),
    ("both", {"bad_words": ["x", "no way"]}),
    ("both", {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False}}),
    ("chat", {"add_generation_prompt": True, "continue_final_message": False, "add_special_tokens": False}),
    ("chat", {"modalities": ["text"], "echo": False}),
    ("completion", {"add_special_tokens": True, "echo": True}),
    ("completion", {"echo": False, "logprobs": 2}),
    ("completion", {"echo": True, "logprobs": 2}),  # the prompt's logprobs come first
    ("both", {"prompt_logprobs": 1}),
    ("both", {"metadata": {"a": "b"}, "store": False, "service_tier": "auto", "priority": 0, "prediction": None,
              "user": "u", "frobnicate": [1]}),
]


@pytest.mark.parametrize("kind,patch", [pytest.param(k, p, id=f"{k}-{i}") for i, (ks, p) in enumerate(ACCEPTED)
                                        for k in (("chat", "completion") if ks == "both" else (ks,))])
def test_harmless_fields_pass(client, kind, patch):
    srv, c = client
    path, body = ENDPOINTS[kind]
    r = c.post(path, json={**body, **patch})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_allowed_token_ids_reach_the_engine_or_are_refused(client, kind):
    srv, c = client
    path, body = ENDPOINTS[kind]
    r = c.post(path, json={**body, "allowed_token_ids": [5, 6, 33]})
    assert r.status_code == 200, r.text
    assert srv.engine.params_seen[srv.engine.started[-1][0]].allowed_token_ids == [5, 6, 33]
    for bad in ([], [5, -1], "5", [FAKE_VOCAB]):
        _envelope(c.post(path, json={**body, "allowed_token_ids": bad}), 400, param="allowed_token_ids")


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_bad_words_reach_the_engine_or_are_refused(client, kind):
    srv, c = client
    path, body = ENDPOINTS[kind]
    r = c.post(path, json={**body, "bad_words": ["darn", "no way"]})
    assert r.status_code == 200, r.text
    assert srv.engine.params_seen[srv.engine.started[-1][0]].bad_words == ["darn", "no way"]
    for bad in ("darn", [""], ["ok", 5], [" "]):
        _envelope(c.post(path, json={**body, "bad_words": bad}), 400, param="bad_words")
