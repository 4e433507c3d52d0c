"""Structured output after reasoning over HTTP (reasoned_constraints.py), on a scripted engine
with a real tiny tokenizer that has ``<think>``/``</think>`` tokens: the boundary the engine gets
(the tag ids as the tokenizer encodes them, where the output starts as the prompt says), and the
answer read out of the output: reasoning to ``reasoning``/``reasoning_content``, the constrained
rest to ``content`` or a tool choice's call, the same whole, streamed and as Responses items; an
output cut inside its reasoning has no content and no call."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.engine.reasoning_helpers import END_THINK, THINK, thinking_tokenizer
from tests.server.scripted_engine import ScriptedEngine
from tests.server.test_auto_tools_fake import PATH, PLACE, TOOLS, USER, _join, _sse, _whole
from tests.server.test_responses_fake import TOOLS as FLAT_TOOLS
from tests.server.test_responses_fake import _streamed, _whole_items

JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "place", "schema": PLACE}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# what a thinking model writes, as the engine hands it over: cut inside the end tag and the JSON
REASONED = ["<think>\nOslo is in", " Norway.\n</th", "ink>", '{"city":', ' "Oslo"}']
REASONING, ANSWER = "\nOslo is in Norway.\n", '{"city": "Oslo"}'
REQUIRED_ANSWER = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'


@pytest.fixture
def serve(server_factory):
    def make(*scripts, **settings):
        engine = ScriptedEngine(*scripts, max_model_len=1024)
        engine.tokenizer = thinking_tokenizer()
        srv = server_factory(engine, **settings)
        return srv, srv.tenant_client(srv.make_tenant("think"))
    return make


def _boundary(srv):
    return srv.engine.params_seen[srv.engine.started[-1][0]].reasoning_boundary


@pytest.mark.parametrize("parser,thinking,starts_in", [
    ("qwen3", True, "either"),  # Qwen3 writes <think> itself, or answers at once
    ("deepseek_r1", True, "reasoning"),  # R1 starts inside its reasoning
    ("qwen3", False, "content"),  # the template closed the reasoning in the prompt
    ("deepseek_r1", False, "content"),
])
def test_the_engine_gets_the_boundary_of_every_constraint(serve, parser, thinking, starts_in):
    srv, c = serve(*[[ANSWER]] * 6, reasoning_parser=parser)
    tok = thinking_tokenizer()
    kwargs = {"enable_thinking": thinking}
    for extra in ({"response_format": JSON_FORMAT}, {"structured_outputs": {"regex": "[a-z]+"}},
                  {"guided_choice": ["yes", "no"]}, {"tools": TOOLS, "tool_choice": NAMED},
                  {"tools": TOOLS, "tool_choice": "required"}):
        r = c.post(PATH, json={"model": "fake-model", "messages": USER, "chat_template_kwargs": kwargs, **extra})
        assert r.status_code == 200, r.text
        b = _boundary(srv)
        assert b.end_token_ids == (tok.convert_tokens_to_ids(END_THINK),)
        assert b.start_token_ids == (tok.convert_tokens_to_ids(THINK),) and b.starts_in == starts_in
    # no constraint, or completions: no boundary
    c.post(PATH, json={"model": "fake-model", "messages": USER})
    assert _boundary(srv) is None
    c.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "guided_choice": ["yes", "no"]})
    assert _boundary(srv) is None


def test_no_reasoning_parser_no_boundary_and_the_text_is_the_answer(serve):
    srv, c = serve([ANSWER], reasoning_parser=None)
    choice = c.post(PATH, json={"model": "fake-model", "messages": USER, "response_format": JSON_FORMAT}).json()
    assert _boundary(srv) is None
    assert choice["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_json_after_reasoning_whole_streamed_and_responses(serve, parser):
    srv, c = serve(REASONED, REASONED, REASONED, REASONED, reasoning_parser=parser)
    body = {"model": "fake-model", "messages": USER, "response_format": JSON_FORMAT}
    choice = c.post(PATH, json=body).json()["choices"][0]
    msg = choice["message"]
    assert (msg["reasoning"], msg["reasoning_content"], msg["content"]) == (REASONING, REASONING, ANSWER)
    jsonschema.validate(json.loads(msg["content"]), PLACE)
    assert choice["finish_reason"] == "stop"
    assert _join(_sse(c.post(PATH, json={**body, "stream": True}))) == _whole(choice)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=c.headers["Authorization"][7:], max_retries=0)
    fmt = {"format": {"type": "json_schema", "name": "place", "schema": PLACE}}
    resp = client.responses.create(model="fake-model", input="Oslo?", text=fmt)
    assert _boundary(srv) is not None
    assert _whole_items(resp) == [("reasoning", REASONING), ("message", ANSWER)] and resp.status == "completed"
    streamed, final = _streamed(client.responses.create(model="fake-model", input="Oslo?", text=fmt, stream=True))
    assert streamed == _whole_items(resp) and final.status == "completed"


def test_prompt_closed_reasoning_the_whole_output_is_the_answer(serve):
    srv, c = serve([ANSWER], [ANSWER], reasoning_parser="qwen3")
    body = {"model": "fake-model", "messages": USER, "response_format": JSON_FORMAT,
            "chat_template_kwargs": {"enable_thinking": False}}
    choice = c.post(PATH, json=body).json()["choices"][0]
    assert _boundary(srv).starts_in == "content"
    assert (choice["message"]["content"], choice["message"]["reasoning"]) == (ANSWER, None)
    assert _join(_sse(c.post(PATH, json={**body, "stream": True}))) == _whole(choice)


def test_reasoning_cut_by_max_tokens_has_no_content(serve):
    """max_tokens counts the reasoning: an output that ends inside it is "length", with its
    reasoning and null content (vLLM's answer), an incomplete response with only a reasoning item."""
    srv, c = serve(REASONED, REASONED, REASONED, REASONED, reasoning_parser="deepseek_r1")
    body = {"model": "fake-model", "messages": USER, "response_format": JSON_FORMAT, "max_tokens": 2}
    choice = c.post(PATH, json=body).json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] is None and choice["message"]["reasoning"] == "\nOslo is in Norway.\n</th"
    assert _join(_sse(c.post(PATH, json={**body, "stream": True}))) == _whole(choice)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=c.headers["Authorization"][7:], max_retries=0)
    fmt = {"format": {"type": "json_schema", "name": "place", "schema": PLACE}}
    resp = client.responses.create(model="fake-model", input="Oslo?", text=fmt, max_output_tokens=2)
    assert resp.status == "incomplete" and [i.type for i in resp.output] == ["reasoning"]
    streamed, final = _streamed(client.responses.create(model="fake-model", input="Oslo?", text=fmt,
                                                        max_output_tokens=2, stream=True))
    assert streamed == _whole_items(resp) and final.status == "incomplete"


@pytest.mark.parametrize("choice_field,answer,reason", [
    (NAMED, ANSWER, "stop"),
    ("required", REQUIRED_ANSWER, "tool_calls"),
])
def test_tool_choice_after_reasoning(serve, choice_field, answer, reason):
    pieces = ["<think>\nNeed", " the weather.</think>", answer[:9], answer[9:]]
    srv, c = serve(*[pieces] * 4, reasoning_parser="qwen3")
    body = {"model": "fake-model", "messages": USER, "tools": TOOLS, "tool_choice": choice_field, "n": 2}
    choices = c.post(PATH, json=body).json()["choices"]
    for choice in choices:  # each choice read on its own
        msg = choice["message"]
        assert choice["finish_reason"] == reason and msg["content"] is None
        assert msg["reasoning"] == msg["reasoning_content"] == "\nNeed the weather."
        assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in msg["tool_calls"]] == [
            ("get_weather", {"city": "Oslo"})]
    chunks = _sse(c.post(PATH, json={**body, "stream": True}))
    assert [_join(chunks, i) for i in (0, 1)] == [_whole(choice) for choice in choices]
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=c.headers["Authorization"][7:], max_retries=0)
    tool_choice = {"type": "function", "name": "get_weather"} if choice_field == NAMED else "required"
    resp = client.responses.create(model="fake-model", input="Oslo?", tools=FLAT_TOOLS, tool_choice=tool_choice)
    items = _whole_items(resp)
    assert [i[0] for i in items] == ["reasoning", "function_call"] and items[0][1] == "\nNeed the weather."
    streamed, _ = _streamed(client.responses.create(model="fake-model", input="Oslo?", tools=FLAT_TOOLS,
                                                    tool_choice=tool_choice, stream=True))
    assert streamed == items


def test_tool_choice_cut_inside_reasoning_makes_no_call(serve):
    pieces = ["<think>\nNeed", " the weather", " in Oslo.</think>", ANSWER]
    srv, c = serve(pieces, pieces, reasoning_parser="qwen3")
    body = {"model": "fake-model", "messages": USER, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 2}
    choice = c.post(PATH, json=body).json()["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert (choice["message"]["content"], choice["message"]["reasoning"]) == (None, "\nNeed the weather")
    assert _join(_sse(c.post(PATH, json={**body, "stream": True}))) == _whole(choice)
