"""``POST /v1/responses``: what is not served (state, background runs, built-in tools, images and
files ...) and what is malformed is a 400 in OpenAI's error shape whose ``param`` names the
Responses field (not the chat field it maps to), streamed or not, with nothing started: no
engine request, no tenant or drain slot, no adapter version held. Harmless fields pass."""

from __future__ import annotations

import json
import logging

import pytest

from tests.server.test_errors_fake import _envelope

BASE = {"model": "fake-model", "input": "hi", "max_output_tokens": 2}
FN = {"type": "function", "name": "f", "parameters": {"type": "object"}}
UNSUPPORTED = "unsupported_parameter"
LOGPROBS = "message.output_text.logprobs"

REFUSED = [
    ({"previous_response_id": "resp_1"}, "previous_response_id", UNSUPPORTED),
    ({"conversation": "conv_1"}, "conversation", UNSUPPORTED),
    ({"background": True}, "background", UNSUPPORTED),
    # include: an item vLLM does not take, one OpenAI names for a tool not run here, a bad shape
    ({"include": ["message.output_text.logprob"]}, "include", None),
    ({"include": ["web_search_call.action.sources"]}, "include", UNSUPPORTED),
    ({"include": "message.output_text.logprobs"}, "include", None),
    ({"include": [LOGPROBS], "top_logprobs": 21}, "top_logprobs", None),  # past the server's --max-logprobs (20)
    ({"top_logprobs": 21}, "top_logprobs", None),  # checked even where nothing asks for logprobs
    ({"include": [LOGPROBS], "top_logprobs": -1}, "top_logprobs", None),
    ({"include": [LOGPROBS], "top_logprobs": True}, "top_logprobs", None),
    ({"truncation": "left"}, "truncation", None),
    ({"reasoning": {"effort": "high"}}, "reasoning", UNSUPPORTED),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", UNSUPPORTED),
    ({"max_tool_calls": 2}, "max_tool_calls", UNSUPPORTED),
    ({"tools": [{"type": "web_search"}]}, "tools", UNSUPPORTED),
    ({"tools": [FN, {"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools", UNSUPPORTED),
    ({"tools": [FN], "tool_choice": {"type": "web_search_preview"}}, "tool_choice", UNSUPPORTED),
    # "auto" (the default with tools) needs the server's --tool-call-parser, as on chat completions
    ({"tools": [FN]}, "tools", UNSUPPORTED),
    ({"tools": [FN], "tool_choice": "auto"}, "tool_choice", UNSUPPORTED),
    ({"tools": [FN], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice", None),
    ({"tools": [FN], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "tool_choice", None),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "see"},
                                             {"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[1]", UNSUPPORTED),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
     "input[0].content[0]", UNSUPPORTED),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", UNSUPPORTED),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", None),
    ({"input": ["hi"]}, "input[0]", None),
    ({"input": []}, "input", None),
    ({"input": None}, "input", None),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call_output", "output": "x"}]},
     "input[1].call_id", None),
    ({"input": [{"type": "function_call", "call_id": "c1", "arguments": "{}"}]}, "input[0].name", None),
    ({"instructions": ["be brief"]}, "instructions", None),
    ({"max_output_tokens": 0}, "max_output_tokens", None),
    ({"max_output_tokens": 10_000}, "max_output_tokens", None),  # more than the context leaves
    ({"input": "a " * 200}, "input", None),  # a prompt longer than the context
    ({"temperature": 3}, "temperature", None),
    ({"top_p": "high"}, "top_p", None),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": "an object"}}}, "text.format.schema", None),
    ({"text": {"format": {"type": "regex", "pattern": "a+"}}}, "text.format", None),
    ({"text": "json"}, "text", None),
    ({"metadata": {"n": 1}}, "metadata", None),
    # OpenAI's limits and requirements
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", None),
    ({"metadata": {"k" * 65: "v"}}, "metadata", None),
    ({"metadata": {"k": "v" * 513}}, "metadata", None),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name", None),
    # stateless: an output needs its call in the same input
    ({"input": [{"role": "user", "content": "hi"},
                {"type": "function_call_output", "call_id": "c9", "output": "x"}]}, "input[1].call_id", None),
    # chat's beam search (beam_fields.py) is not served here: told, not answered with a sampled reply
    ({"use_beam_search": True}, "use_beam_search", UNSUPPORTED),
    ({"store": "yes"}, "store", None),
    ({"model": 3}, "model", None),  # left out or null: the base model (vLLM's), as chat (test_openai_fake.py)
]


@pytest.fixture(scope="module")
def world(module_server):
    srv = module_server
    key = srv.make_tenant("rsp")
    sha = srv.upload("rsp", "sql", b"rsp-v1")["sha256"]
    with srv.tenant_client(key) as client:
        yield srv, client, sha


def _nothing_held(srv, sha) -> None:
    ctx = srv.app.state.ctx
    assert ctx.limiter.in_flight() == 0 and ctx.lifecycle.in_flight == 0
    assert srv.adapters.in_use.get(sha, 0) == 0


@pytest.mark.parametrize("patch,param,code", REFUSED, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(REFUSED)])
@pytest.mark.parametrize("model", ["fake-model", "sql"])
def test_refused_with_the_field_named_and_nothing_started(world, patch, param, code, model):
    srv, client, sha = world
    before = len(srv.engine.started)
    for stream in (False, True):  # a stream is refused before it starts, not in-band
        body = {**BASE, "model": model, **patch, "stream": stream}
        err = _envelope(client.post("/v1/responses", json=body), 400, code=code, param=param)
        assert f"`{param.split('[')[0]}" in err["message"] or param.startswith("input")
    assert len(srv.engine.started) == before
    _nothing_held(srv, sha)


def test_unknown_model_is_404(world):
    srv, client, sha = world
    _envelope(client.post("/v1/responses", json={**BASE, "model": "nope"}), 404, code="model_not_found")
    _nothing_held(srv, sha)


ACCEPTED = [
    {"store": True}, {"store": False}, {"metadata": {"k": "v"}}, {"reasoning": None}, {"reasoning": {"effort": None}},
    {"include": []}, {"include": None}, {"truncation": "disabled"}, {"truncation": "auto"}, {"truncation": None},
    # vLLM's include items: logprobs are served; the others have nothing to add here (no encrypted
    # reasoning, no built-in tools or images), and vLLM takes them the same way
    {"include": [LOGPROBS]}, {"include": [LOGPROBS], "top_logprobs": 20},
    {"include": ["reasoning.encrypted_content", "code_interpreter_call.outputs", "file_search_call.results",
                 "computer_call_output.output.image_url", "message.input_image.image_url"]},
    {"top_logprobs": 5},  # without include's logprobs it asks for nothing (vLLM, OpenAI)
    {"background": False}, {"previous_response_id": None},
    {"text": {"format": {"type": "text"}}}, {"service_tier": "auto"}, {"user": "u1"}, {"tools": []},
    {"tools": [FN], "tool_choice": "none"}, {"parallel_tool_calls": False}, {"top_logprobs": 0},
    {"use_beam_search": False},
    {"input": [{"role": "developer", "content": "be brief"}, {"type": "message", "role": "user", "content": "hi"}]},
]


@pytest.mark.parametrize("patch", ACCEPTED, ids=[str(i) for i in range(len(ACCEPTED))])
def test_harmless_fields_pass(world, patch):
    srv, client, sha = world
    r = client.post("/v1/responses", json={**BASE, "model": "sql", **patch})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "response" and srv.engine.started[-1][1] == sha
    _nothing_held(srv, sha)


def test_access_lines_say_responses(world, caplog):
    srv, client, sha = world
    with caplog.at_level(logging.INFO, logger="loraplex.access"):
        assert client.post("/v1/responses", json=BASE).status_code == 200
        assert client.post("/v1/responses", json={**BASE, "background": True}).status_code == 400
    records = [json.loads(r.getMessage()) for r in caplog.records if r.name == "loraplex.access"]
    assert [(r["endpoint"], r["status"]) for r in records] == [("responses", 200), ("responses", 400)]
