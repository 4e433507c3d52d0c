"""LoRAX's native API (/generate, /generate_stream, POST /) over the fake engine: shapes, the
mapping of LoRAX's parameters onto SamplingParams, refusals, errors in LoRAX's shape, and the
shared machinery (tenants, adapters, limits, access log, disconnects). A real model and the
lorax-client package: tests/e2e/test_lorax_api_e2e.py."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest

from loraplex.structured_output import StructuredOutputs
from tests.server.fakes import FakeEngine, expected_text

MAX_MODEL_LEN = 128  # the fake engine's


@pytest.fixture(scope="module")
def world(module_server):
    srv = module_server
    key = srv.make_tenant("lx")
    version = srv.upload("lx", "sql", b"lx-v1")
    with srv.tenant_client(key) as client:
        yield srv, client, version["sha256"]


def _post(client, path: str, inputs: str = "hello world", **parameters) -> httpx.Response:
    return client.post(path, json={"inputs": inputs, "parameters": parameters})


def _params(srv):
    """The SamplingParams of the engine's latest request (tests in a module run one at a time)."""
    return list(srv.engine.params_seen.values())[-1]


def _events(response: httpx.Response) -> list[dict]:
    assert response.headers["content-type"].startswith("text/event-stream")
    return [json.loads(line[5:]) for line in response.text.splitlines() if line.startswith("data:")]


def test_generate_text_details_and_adapter(world):
    srv, client, sha = world
    tok = srv.engine.tokenizer
    ids = tok("hello world")["input_ids"]
    r = _post(client, "/t/lx/generate", adapter_id="sql", max_new_tokens=7, details=True)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["generated_text"] == expected_text(tok, ids, sha, None, 7)  # greedy: no seed
    d = body["details"]
    assert (d["finish_reason"], d["prompt_tokens"], d["generated_tokens"], d["seed"], d["prefill"]) == (
        "length", len(ids), 7, None, [])
    assert "".join(t["text"] for t in d["tokens"]) == body["generated_text"]
    assert all(set(t) == {"id", "text", "logprob", "special"} and t["logprob"] == -0.5 for t in d["tokens"])
    assert r.headers["x-adapter-id"] == "sql" and r.headers["x-model-id"] == "fake-model"
    assert (r.headers["x-prompt-tokens"], r.headers["x-generated-tokens"]) == (str(len(ids)), "7")
    # name@N, and the key deciding the tenant; the base model when adapter_id is absent, empty or its name
    assert _post(client, "/generate", adapter_id="sql@1", max_new_tokens=7).json() == {
        "generated_text": body["generated_text"]}
    base = expected_text(tok, ids, None, None, 4)
    for extra in ({}, {"adapter_id": ""}, {"adapter_id": "fake-model"}, {"adapter_id": None}):
        r = _post(client, "/t/lx/generate", max_new_tokens=4, **extra)
        assert r.json() == {"generated_text": base} and "x-adapter-id" not in r.headers
    assert srv.adapters.in_use[sha] == 0  # every request gave its version back


def test_return_full_text_and_default_max_new_tokens(world):
    srv, client, _ = world
    ids = srv.engine.tokenizer("hi")["input_ids"]
    body = _post(client, "/t/lx/generate", "hi", return_full_text=True, details=True).json()
    assert body["generated_text"].startswith("hi")
    assert body["details"]["generated_tokens"] == MAX_MODEL_LEN - len(ids)  # what the context leaves (LoRAX)
    assert len(body["generated_text"]) == 2 + MAX_MODEL_LEN - len(ids)


@pytest.mark.parametrize("parameters, want", [
    ({}, dict(temperature=0.0, seed=None, top_k=0, top_p=1.0, logprobs=None, prompt_logprobs=None)),
    ({"do_sample": True, "seed": 5}, dict(temperature=1.0, seed=5)),
    ({"temperature": 0.5, "seed": 1}, dict(temperature=0.5, seed=1)),  # a warper turns sampling on
    ({"top_k": 5, "seed": 1}, dict(temperature=1.0, top_k=5)),
    ({"do_sample": True, "seed": 2**64 - 1}, dict(seed=2**64 - 1)),  # u64::MAX, as LoRAX takes it
    ({"top_p": 0.9, "seed": 1}, dict(temperature=1.0, top_p=0.9)),
    ({"temperature": 0, "do_sample": True, "seed": 3}, dict(temperature=0.0, seed=None)),  # 0 is greedy
    ({"temperature": 1.0, "top_p": 1.0}, dict(temperature=0.0)),  # no-op values: still greedy
    ({"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": -0.5},
     dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=-0.5)),
    ({"stop": ["xy", "z"], "ignore_eos_token": True},
     dict(stop=["xy", "z"], ignore_eos=True, include_stop_str_in_output=True)),
    ({"details": True}, dict(logprobs=0)),
    ({"return_k_alternatives": 3}, dict(logprobs=3)),
    ({"decoder_input_details": True}, dict(logprobs=0, prompt_logprobs=0)),
    ({"max_new_tokens": 9}, dict(max_tokens=9)),
    ({"response_format": {"type": "json_object", "schema": {"type": "object"}}},
     dict(structured_outputs=StructuredOutputs(json={"type": "object"}))),
    ({"response_format": {"type": "json_object"}}, dict(structured_outputs=StructuredOutputs(json_object=True))),
    ({"grammar": {"type": "regex", "value": "[a-c]+"}}, dict(structured_outputs=StructuredOutputs(regex="[a-c]+"))),
    ({"grammar": {"type": "json", "value": {"type": "array"}}},
     dict(structured_outputs=StructuredOutputs(json={"type": "array"}))),
])
def test_parameters_map_onto_sampling_params(world, parameters, want):
    srv, client, _ = world
    r = _post(client, "/t/lx/generate", **{"max_new_tokens": 3, **parameters})
    assert r.status_code == 200, r.text
    params = _params(srv)
    assert {k: getattr(params, k) for k in want} == want


def test_seeds_reported_and_reproducible(world):
    _, client, _ = world
    first = _post(client, "/t/lx/generate", do_sample=True, max_new_tokens=8, details=True).json()
    seed = first["details"]["seed"]
    assert isinstance(seed, int) and 0 <= seed < 2**53  # LoRAX picks one when none is sent
    again = _post(client, "/t/lx/generate", do_sample=True, seed=seed, max_new_tokens=8, details=True).json()
    assert again["generated_text"] == first["generated_text"] and again["details"]["seed"] == seed
    greedy = _post(client, "/t/lx/generate", seed=seed, max_new_tokens=2, details=True).json()
    assert greedy["details"]["seed"] is None  # greedy: no sampling seed


def test_alternatives_truncate_and_stop_sequence(world):
    srv, client, _ = world
    tok = srv.engine.tokenizer
    body = _post(client, "/t/lx/generate", return_k_alternatives=2, max_new_tokens=3, details=True).json()
    for t in body["details"]["tokens"]:
        assert [a["logprob"] for a in t["alternative_tokens"]] == [-0.5, -1.5]
        assert t["alternative_tokens"][0] == {"id": t["id"], "text": t["text"], "logprob": -0.5}
    # truncate keeps the prompt's last N tokens
    body = _post(client, "/t/lx/generate", "abcdef", truncate=2, max_new_tokens=3, details=True).json()
    assert body["details"]["prompt_tokens"] == 2
    assert body["generated_text"] == expected_text(tok, tok("abcdef")["input_ids"][-2:], None, None, 3)
    # a stop sequence: finish_reason "stop_sequence"
    text = _post(client, "/t/lx/generate", max_new_tokens=10).json()["generated_text"]
    d = _post(client, "/t/lx/generate", max_new_tokens=10, stop=[text[4]], details=True).json()["details"]
    assert d["finish_reason"] == "stop_sequence" and d["generated_tokens"] == text.index(text[4]) + 1


def test_stream_events(world):
    srv, client, sha = world
    r = _post(client, "/t/lx/generate_stream", adapter_id="sql", max_new_tokens=6, details=True)
    assert r.status_code == 200 and r.headers["x-adapter-id"] == "sql"
    events = _events(r)
    whole = _post(client, "/t/lx/generate", adapter_id="sql", max_new_tokens=6, details=True).json()
    assert len(events) == 6 and "[DONE]" not in r.text
    assert [e["token"] for e in events] == whole["details"]["tokens"]
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    assert events[-1]["generated_text"] == "".join(e["token"]["text"] for e in events) == whole["generated_text"]
    assert events[-1]["details"] == {"finish_reason": "length", "prompt_tokens": whole["details"]["prompt_tokens"],
                                     "generated_tokens": 6, "seed": None}
    # without `details`, still one event per token (with its logprob), the last one without details
    events = _events(_post(client, "/generate_stream", max_new_tokens=2, return_full_text=True))
    assert [e["details"] for e in events] == [None, None]
    assert events[-1]["generated_text"] == "hello world" + "".join(e["token"]["text"] for e in events)
    assert all(isinstance(e["token"]["logprob"], float) for e in events)


def test_compat_route(world):
    srv, client, _ = world
    body = {"inputs": "hello world", "parameters": {"max_new_tokens": 3}}
    for path in ("/t/lx", "/"):
        r = client.post(path, json=body)
        assert r.status_code == 200 and r.json() == [_post(client, "/generate", max_new_tokens=3).json()]
        events = _events(client.post(path, json={**body, "stream": True}))
        assert len(events) == 3 and events[-1]["generated_text"] == r.json()[0]["generated_text"]
    assert client.post("/t/lx", json={**body, "stream": "yes"}).status_code == 422


LORAX_CLIENT_DEFAULTS = {  # what lorax-client 0.6.3 sends when given only a prompt
    "adapter_id": None, "adapter_source": None, "merged_adapters": None, "api_token": None, "do_sample": False,
    "max_new_tokens": 3, "ignore_eos_token": False, "repetition_penalty": None, "return_full_text": False,
    "stop": [], "seed": None, "temperature": None, "top_k": None, "top_p": None, "truncate": None,
    "typical_p": None, "best_of": None, "watermark": False, "details": True, "decoder_input_details": False,
    "return_k_alternatives": None, "response_format": None,
}


@pytest.mark.parametrize("extra", [{}, {"adapter_source": "local"}, {"typical_p": 1.0}, {"best_of": 1},
                                   {"apply_chat_template": False}, {"top_n_tokens": 0}, {"unknown_field": 1}])
def test_no_op_values_are_accepted(world, extra):
    _, client, _ = world
    r = client.post("/t/lx", json={"inputs": "hi", "parameters": {**LORAX_CLIENT_DEFAULTS, **extra}, "stream": False})
    assert r.status_code == 200, r.text
    assert r.json()[0]["details"]["generated_tokens"] == 3


@pytest.mark.parametrize("parameters, field", [
    ({"adapter_source": "hub"}, "adapter_source"),
    ({"adapter_source": "s3"}, "adapter_source"),
    ({"adapter_source": "pbase"}, "adapter_source"),
    # the fake adapter store has no files to merge (a real one: test_merged_adapters_fake.py)
    ({"merged_adapters": {"ids": ["a", "b"], "weights": [0.5, 0.5]}}, "merged_adapters"),
    ({"watermark": True}, "watermark"),
    ({"typical_p": 0.5}, "typical_p"),
    ({"best_of": 2, "do_sample": True}, "best_of"),
    ({"apply_chat_template": True}, "apply_chat_template"),
    ({"top_n_tokens": 3}, "top_n_tokens"),
])
def test_unsupported_parameters_are_refused(world, parameters, field):
    srv, client, _ = world
    started = len(srv.engine.started)
    for path in ("/t/lx/generate", "/t/lx/generate_stream"):
        r = _post(client, path, **parameters)
        assert r.status_code == 422, r.text
        assert r.json()["error_type"] == "validation" and f"`{field}`" in r.json()["error"]
    assert len(srv.engine.started) == started  # refused before any model work


@pytest.mark.parametrize("body, field", [
    ({"parameters": {}}, "inputs"),
    ({"inputs": ""}, "inputs"),
    ({"inputs": ["a", "b"]}, "inputs"),
    ({"inputs": "x", "parameters": [1]}, "parameters"),
    ({"inputs": "x", "parameters": {"temperature": -1}}, "temperature"),
    ({"inputs": "x", "parameters": {"temperature": "hot"}}, "temperature"),
    ({"inputs": "x", "parameters": {"top_k": 0}}, "top_k"),
    ({"inputs": "x", "parameters": {"top_p": 1.5}}, "top_p"),
    ({"inputs": "x", "parameters": {"top_p": 0}}, "top_p"),
    ({"inputs": "x", "parameters": {"typical_p": 0}}, "typical_p"),
    ({"inputs": "x", "parameters": {"best_of": 0}}, "best_of"),
    ({"inputs": "x", "parameters": {"repetition_penalty": 0}}, "repetition_penalty"),
    # integers no float holds (JSON's 1e400 reads as inf, 10**400 written out is an int): were 500s
    ({"inputs": "x", "parameters": {"temperature": 10**400}}, "temperature"),
    ({"inputs": "x", "parameters": {"top_p": 10**400}}, "top_p"),
    ({"inputs": "x", "parameters": {"typical_p": 10**400}}, "typical_p"),
    ({"inputs": "x", "parameters": {"repetition_penalty": 10**400}}, "repetition_penalty"),
    ({"inputs": "x", "parameters": {"max_new_tokens": 0}}, "max_new_tokens"),
    ({"inputs": "x", "parameters": {"max_new_tokens": 1000}}, "max"),  # past the context
    ({"inputs": "x", "parameters": {"seed": -1}}, "seed"),
    # LoRAX's seed is a u64: past it the sampler's 64 bits would alias 2**64 to seed 0
    ({"inputs": "x", "parameters": {"seed": 2**64, "do_sample": True}}, "seed"),
    ({"inputs": "x", "parameters": {"truncate": 0}}, "truncate"),
    ({"inputs": "x", "parameters": {"stop": [""]}}, "stop"),
    ({"inputs": "x", "parameters": {"adapter_id": 3}}, "adapter_id"),
    ({"inputs": "x", "parameters": {"details": "yes"}}, "details"),
    ({"inputs": "x", "parameters": {"return_k_alternatives": 50}}, "return_k_alternatives"),
    ({"inputs": "x", "parameters": {"response_format": {"type": "json_schema"}}}, "response_format"),
    ({"inputs": "x", "parameters": {"response_format": {"type": "json_object", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "("}}}, "grammar"),
    ({"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "a"},
                                    "response_format": {"type": "json_object"}}}, "grammar"),
])
def test_bad_input_is_422_validation(world, body, field):
    _, client, _ = world
    r = client.post("/t/lx/generate", json=body)
    assert r.status_code == 422, r.text
    assert r.json()["error_type"] == "validation" and field in r.json()["error"]


def test_decoder_input_details_not_with_streams_and_bad_json(world):
    _, client, _ = world
    r = _post(client, "/t/lx/generate_stream", decoder_input_details=True)
    assert r.status_code == 422 and "decoder_input_details" in r.json()["error"]
    r = client.post("/t/lx/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"


def test_auth_and_unknown_adapters(world):
    srv, client, _ = world
    other = srv.make_tenant("lx-other")
    r = httpx.post(srv.url + "/t/lx/generate", json={"inputs": "x"})
    assert r.status_code == 401 and r.json()["error_type"] == "authentication"
    r = httpx.post(srv.url + "/t/lx/generate", json={"inputs": "x"}, headers={"Authorization": f"Bearer {other}"})
    assert r.status_code == 401  # a key of another tenant
    with srv.tenant_client(other) as c:  # lx's adapter is not lx-other's: the same 404 as no adapter at all
        for adapter in ("sql", "nope", "sql@9"):
            r = _post(c, "/generate_stream", adapter_id=adapter)
            assert r.status_code == 404 and r.json() == {
                "error": f"Adapter `{adapter}` does not exist or you do not have access to it.",
                "error_type": "not_found"}


def test_access_log_and_metrics(world, caplog):
    srv, client, _ = world
    with caplog.at_level(logging.INFO, logger="loraplex.access"):
        _post(client, "/t/lx/generate_stream", adapter_id="sql@1", max_new_tokens=2)
        _post(client, "/t/lx/generate", watermark=True)
        deadline = time.monotonic() + 5
        while len(caplog.records) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    ok, refused = (json.loads(r.getMessage()) for r in caplog.records[:2])
    assert (ok["endpoint"], ok["stream"], ok["adapter"], ok["version"], ok["status"], ok["completion_tokens"]) == (
        "generate", True, "sql", 1, 200, 2)
    assert (refused["endpoint"], refused["status"]) == ("generate", 422)
    metrics = httpx.get(srv.url + "/metrics").text
    assert 'loraplex_adapter_requests_total{adapter="lx/sql"}' in metrics
    assert 'loraplex_http_requests_total{route="generate_stream",status="200"}' in metrics
    assert 'loraplex_http_requests_total{route="generate",status="422"}' in metrics


def test_overloaded_and_disconnect(server_factory):
    srv = server_factory(FakeEngine(step_seconds=0.05), max_concurrent_requests_per_tenant=1)
    key = srv.make_tenant("busy")
    with srv.tenant_client(key) as client:
        body = {"inputs": "hello", "parameters": {"max_new_tokens": 100}}
        with client.stream("POST", "/t/busy/generate_stream", json=body) as stream:
            lines = stream.iter_lines()  # kept: a dropped iterator closes the stream
            assert json.loads(next(lines)[5:])["token"]["text"]
            r = client.post("/t/busy/generate", json=body)
            assert r.status_code == 429 and r.json()["error_type"] == "overloaded" and r.headers["retry-after"]
        # the client went away mid-stream: its engine request is aborted, its tenant slot given back
        deadline = time.monotonic() + 5
        while (srv.app.state.ctx.limiter.in_flight("busy") or not srv.engine.aborted) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.app.state.ctx.limiter.in_flight("busy") == 0 and srv.engine.aborted
        assert srv.engine.blocks_in_use == {}
