"""Tool calling over the HTTP layer (fake engine): tools and tool_choice checked (a 400 naming the
field, before anything reaches the engine), the constraint of a named or "required" choice handed
to the engine, tools and earlier tool calls passed to the chat template, the response and stream
shapes of tool calls; and the reader that splits a "required" output into calls as it streams.

The fake engine ignores constraints (its output is letters), so what a real model produces
under them is checked in tests/e2e/test_openai_compat_e2e.py."""

from __future__ import annotations

import json
import random

import jinja2
import pytest

from loraplex.server.call_reader import CallArrayReader
from loraplex.server.tool_calls import ToolCallStream, ToolRequest, required_calls
from loraplex.structured_output import StructuredOutputs
from tests.server.fakes import FakeEngine, FakeTokenizer, expected_text
from tests.server.test_errors_fake import _envelope

PLACE = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "where", "description": "find a place", "parameters": PLACE}},
    {"type": "function", "function": {"name": "now"}},  # no parameters: any object
]
USER = [{"role": "user", "content": "hi"}]
CHAT = {"model": "fake-model", "messages": USER, "max_tokens": 5, "seed": 3}
PATH = "/v1/chat/completions"


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


@pytest.fixture(scope="module")
def client(module_server):
    key = module_server.make_tenant("tooler")
    with module_server.tenant_client(key) as c:
        yield module_server, c


def _last_params(srv):
    return srv.engine.params_seen[srv.engine.started[-1][0]]


def _prompt_len(messages, tools=None) -> int:
    tok = FakeTokenizer()
    return len(tok(tok.apply_chat_template(messages, tools=tools), add_special_tokens=False)["input_ids"])


# --- the constraint ---------------------------------------------------------------------------


def test_named_choice_keeps_the_output_to_that_tools_parameters(client):
    srv, c = client
    r = c.post(PATH, json={**CHAT, "tools": TOOLS, "tool_choice": named("where")})
    assert r.status_code == 200, r.text
    assert _last_params(srv).structured_outputs == StructuredOutputs(json=PLACE)
    r = c.post(PATH, json={**CHAT, "tools": TOOLS, "tool_choice": named("now")})
    assert r.status_code == 200, r.text
    assert _last_params(srv).structured_outputs == StructuredOutputs(json={"type": "object"})


def test_required_choice_is_an_array_of_calls_to_the_tools(client):
    srv, c = client
    r = c.post(PATH, json={**CHAT, "tools": TOOLS, "tool_choice": "required"})
    assert r.status_code == 200, r.text
    assert _last_params(srv).structured_outputs == StructuredOutputs(json={
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["where"]}, "parameters": PLACE},
             "required": ["name", "parameters"], "additionalProperties": False},
            {"properties": {"name": {"type": "string", "enum": ["now"]}, "parameters": {"type": "object"}},
             "required": ["name", "parameters"], "additionalProperties": False},
        ]},
    })


def test_parallel_tool_calls_false_allows_one_call(client):
    """vLLM keeps the first call when ``parallel_tool_calls`` is false; here the array holds
    one item at most, so the model writes no other."""
    srv, c = client
    r = c.post(PATH, json={**CHAT, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    assert r.status_code == 200, r.text
    schema = _last_params(srv).structured_outputs.json
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)
    r = c.post(PATH, json={**CHAT, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": True})
    assert "maxItems" not in _last_params(srv).structured_outputs.json
    _envelope(c.post(PATH, json={**CHAT, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "no"}),
              400, param="parallel_tool_calls")


def test_required_hoists_each_tools_defs_where_their_refs_point(client):
    srv, c = client
    with_defs = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "a", "parameters": with_defs}},
             {"type": "function", "function": {"name": "b", "parameters": with_defs}}]
    r = c.post(PATH, json={**CHAT, "tools": tools, "tool_choice": "required"})
    assert r.status_code == 200, r.text
    schema = _last_params(srv).structured_outputs.json
    assert schema["$defs"] == {"P": {"type": "integer"}}
    assert all("$defs" not in b["properties"]["parameters"] for b in schema["items"]["anyOf"])
    clash = [tools[0], {"type": "function", "function": {"name": "b", "parameters": {
        **with_defs, "$defs": {"P": {"type": "string"}}}}}]
    _envelope(c.post(PATH, json={**CHAT, "tools": clash, "tool_choice": "required"}), 400, param="tools")


def test_none_sends_no_constraint_but_shows_the_tools(client):
    srv, c = client
    r = c.post(PATH, json={**CHAT, "tools": TOOLS, "tool_choice": "none"})
    assert r.status_code == 200, r.text
    assert _last_params(srv).structured_outputs is None
    assert r.json()["choices"][0]["message"]["content"] is not None
    assert "tool_calls" not in r.json()["choices"][0]["message"]
    assert r.json()["usage"]["prompt_tokens"] == _prompt_len(USER, TOOLS) > _prompt_len(USER)


# --- responses --------------------------------------------------------------------------------


def _sse(r) -> list[dict]:
    lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_named_call_response_and_stream(client):
    srv, c = client
    body = {**CHAT, "tools": TOOLS, "tool_choice": named("where"), "n": 2}
    r = c.post(PATH, json=body)
    assert r.status_code == 200, r.text
    tok = FakeTokenizer()
    prompt = tok(tok.apply_chat_template(USER, tools=TOOLS), add_special_tokens=False)["input_ids"]
    for i, choice in enumerate(r.json()["choices"]):
        msg = choice["message"]
        assert msg["role"] == "assistant" and msg["content"] is None
        (call,) = msg["tool_calls"]
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert call["function"] == {"name": "where", "arguments": expected_text(tok, prompt, None, 3, 5, i)}
        assert choice["finish_reason"] == "length"  # max_tokens cut it: "length" stays
    chunks = _sse(c.post(PATH, json={**body, "stream": True}))
    for i in range(2):
        deltas = [ch["choices"][0] for ch in chunks if ch["choices"][0]["index"] == i]
        assert deltas[0]["delta"] == {"role": "assistant"}
        head = deltas[1]["delta"]["tool_calls"]
        assert len(head) == 1 and head[0]["id"].startswith("call_") and head[0]["type"] == "function"
        assert head[0]["index"] == 0 and head[0]["function"] == {"name": "where", "arguments": ""}
        pieces = [d["delta"]["tool_calls"][0] for d in deltas[2:] if d["delta"]]
        assert all(set(p) == {"index", "function"} and p["index"] == 0 for p in pieces)
        want = r.json()["choices"][i]["message"]["tool_calls"][0]["function"]["arguments"]
        assert "".join(p["function"]["arguments"] for p in pieces) == want
        assert [d["finish_reason"] for d in deltas if d["finish_reason"]] == ["length"]
        assert deltas[-1]["delta"] == {} and deltas[-1]["finish_reason"] == "length"


def test_required_output_cut_short_is_content(client):
    """The fake engine's letters are no array of calls (as a real output cut by max_tokens):
    the text comes back as content, with the engine's finish reason."""
    srv, c = client
    r = c.post(PATH, json={**CHAT, "tools": TOOLS, "tool_choice": "required"})
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "length"
    chunks = _sse(c.post(PATH, json={**CHAT, "tools": TOOLS, "tool_choice": "required", "stream": True}))
    assert not any("tool_calls" in ch["choices"][0]["delta"] for ch in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# --- messages of a tool conversation ----------------------------------------------------------


CALL = {"id": "call_1", "type": "function", "function": {"name": "where", "arguments": '{"city": "Oslo"}'}}
HISTORY = [
    *USER,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def test_tool_calls_and_tool_messages_reach_the_template(client):
    srv, c = client
    r = c.post(PATH, json={**CHAT, "messages": HISTORY, "tools": TOOLS, "tool_choice": "none"})
    assert r.status_code == 200, r.text
    rendered = [
        USER[0],
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "where", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    assert r.json()["usage"]["prompt_tokens"] == _prompt_len(rendered, TOOLS)
    # no tools in this request: the history alone is fine too
    assert c.post(PATH, json={**CHAT, "messages": HISTORY}).status_code == 200


@pytest.mark.parametrize("messages,param", [
    ([*USER, {"role": "tool", "content": "x"}], "messages[1].tool_call_id"),
    ([*USER, {"role": "tool", "tool_call_id": 5, "content": "x"}], "messages[1].tool_call_id"),
    ([*USER, {"role": "assistant", "content": None}], "messages[1].content"),
    ([*USER, {"role": "assistant", "content": None, "tool_calls": "f"}], "messages[1].tool_calls"),
    ([*USER, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}],
     "messages[1].tool_calls"),
    ([*USER, {"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f"}}]}],
     "messages[1].tool_calls"),
    ([*USER, {"role": "robot", "content": "x"}], "messages[1].role"),
])
def test_bad_tool_messages(client, messages, param):
    srv, c = client
    _envelope(c.post(PATH, json={**CHAT, "messages": messages}), 400, param=param)


def test_arguments_not_json_in_history_become_an_empty_object(client):
    """vLLM's rule: a call cut short by max_tokens stays in the history without failing every
    later turn."""
    srv, c = client
    cut = {**CALL, "function": {"name": "where", "arguments": '{"city": "Os'}}
    r = c.post(PATH, json={**CHAT, "messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [cut]}]})
    assert r.status_code == 200, r.text


class _FussyTokenizer(FakeTokenizer):
    """A template that refuses the role "tool" (raise_exception, as many templates do) and
    breaks on tools."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, tools=None):
        if any(m["role"] == "tool" for m in messages):
            raise jinja2.TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")
        if tools:
            raise TypeError("can only concatenate str (not \"dict\") to str")
        return super().apply_chat_template(messages, add_generation_prompt, tokenize)


def test_template_that_cannot_render_tools_is_a_400(server_factory):
    engine = FakeEngine()
    engine.tokenizer = _FussyTokenizer()
    srv = server_factory(engine)
    key = srv.make_tenant("fussy")
    with srv.tenant_client(key) as c:
        err = _envelope(c.post(PATH, json={**CHAT, "messages": HISTORY}), 400, param="messages")
        assert "chat template" in err["message"] and "alternate" in err["message"]
        err = _envelope(c.post(PATH, json={**CHAT, "tools": TOOLS, "tool_choice": named("now"), "stream": True}),
                        400, param="tools")
        assert "chat template" in err["message"]
        assert not engine.started
        assert c.post(PATH, json=CHAT).status_code == 200

# --- validation -------------------------------------------------------------------------------


REFUSED = [
    ({"tools": {"where": PLACE}, "tool_choice": "none"}, "tools"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": "none"}, "tools"),
    ({"tools": [{"type": "code_interpreter"}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}], "tool_choice": "none"},
     "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}], "tool_choice": "none"}, "tools"),
    ({"tools": [TOOLS[1], TOOLS[1]], "tool_choice": "required"}, "tools"),
    # schemas llguidance cannot enforce
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": named("f")}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/nope"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string", "minLength": 5, "maxLength": 2}}}], "tool_choice": "required"}, "tools"),
    # the choice
    ({"tools": TOOLS, "tool_choice": named("elsewhere")}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": 7}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": 1}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": named("where")}, "tool_choice"),
    # one constraint per request
    ({"tools": TOOLS, "tool_choice": named("now"), "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "[a-z]+"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"choice": ["a"]}}, "tool_choice"),
]


@pytest.mark.parametrize("patch,param", REFUSED)
def test_bad_tools_are_a_400_naming_the_field(client, patch, param):
    srv, c = client
    before = len(srv.engine.started)
    for stream in (False, True):  # refused before a stream starts
        _envelope(c.post(PATH, json={**CHAT, **patch, "stream": stream}), 400, param=param)
    assert len(srv.engine.started) == before


@pytest.mark.parametrize("patch,param", [
    ({"tools": TOOLS}, "tools"),  # OpenAI's default choice with tools is "auto"
    ({"tools": TOOLS, "tool_choice": None}, "tools"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
])
def test_auto_tool_choice_is_refused(client, patch, param):
    srv, c = client
    err = _envelope(c.post(PATH, json={**CHAT, **patch}), 400, code="unsupported_parameter", param=param)
    assert "auto" in err["message"] and "parser" in err["message"]


@pytest.mark.parametrize("patch", [
    {"tools": TOOLS, "tool_choice": "none", "response_format": {"type": "json_object"}},  # no tool constraint
    {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "text"}},
    {"tools": [], "tool_choice": "auto"},
    {"tool_choice": "none"},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": PLACE, "strict": True}}],
     "tool_choice": named("f"), "parallel_tool_calls": False},
])
def test_accepted(client, patch):
    srv, c = client
    r = c.post(PATH, json={**CHAT, **patch})
    assert r.status_code == 200, r.text


# --- the reader of "required" outputs ---------------------------------------------------------


OUTPUTS = [
    '[{"name": "f", "parameters": {"a": [1, {"b": "x}]\\"y"}], "c": null}}, {"name":"g","parameters":{}}]',
    # whitespace anywhere; parameters before the name; scalars as parameters
    ' [ {"parameters": {"z": "q"} , "name" : "late"} ,{"name":"n","parameters": -4.5e3 },'
    '{"name":"s","parameters":"st\\"r}"}, {"name":"t","parameters":true}]',
    # a key the schema does not forbid, holding look-alikes
    '[{"name":"f","extra":{"name":"no","parameters":[1]},"parameters":{"k":"v\\u00e9"}}]',
]


@pytest.mark.parametrize("text", OUTPUTS)
def test_streamed_calls_join_into_the_whole_outputs_calls(text):
    whole = required_calls(text)
    assert [n for n, _ in whole] == [it["name"] for it in json.loads(text)]
    assert [json.loads(a) for _, a in whole] == [it["parameters"] for it in json.loads(text)]
    rng = random.Random(0)
    for _ in range(200):  # cut into random pieces, as tokens arrive
        stream, calls, i = ToolCallStream(ToolRequest(mode="required")), {}, 0
        while i < len(text):
            j = i + rng.randint(1, 6)
            for entry in stream.feed(text[i:j]):
                if "id" in entry:  # a call's first delta: id, type, name, empty arguments
                    assert entry["index"] not in calls and entry["index"] == len(calls)
                    assert entry["type"] == "function" and entry["function"]["arguments"] == ""
                    calls[entry["index"]] = [entry["function"]["name"], ""]
                else:
                    assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
                    calls[entry["index"]][1] += entry["function"]["arguments"]
            i = j
        assert [tuple(calls[k]) for k in sorted(calls)] == whole
        assert stream.called()


@pytest.mark.parametrize("text", ['[{"name": "f", "parameters": {"a": 1', "[]", '{"name": "f", "parameters": {}}',
                                  '[{"name": "f"}]', "not json"])
def test_incomplete_required_outputs_are_no_calls(text):
    assert required_calls(text) is None
    stream = ToolCallStream(ToolRequest(mode="required"))
    stream.feed(text)
    assert not stream.called()


def _is_array_of_calls(text: str) -> bool:
    """The reference: what json.loads makes of the whole text."""
    try:
        items = json.loads(text)
    except ValueError:
        return False
    return isinstance(items, list) and bool(items) and all(
        isinstance(it, dict) and isinstance(it.get("name"), str) and "parameters" in it for it in items)


def test_called_agrees_with_parsing_the_whole_output():
    """called() keeps its answer as the stream goes instead of parsing the output again: it
    must still say what parsing the whole text says, for every prefix and for texts broken
    between the items (commas, brackets, what comes after the array)."""
    rng = random.Random(0)
    texts = [*OUTPUTS, '[{"name":"f","parameters":{}},]', '[{"name":"f","parameters":{}} {"name":"g","parameters":1}]',
             '[{"name":"f","parameters":{}}] x', '[,{"name":"f","parameters":{}}]', '[[], {"name":"f","parameters":2}]',
             '[{"name":"f","parameters":{}}]]', '[{"name":"f","parameters":{}}}]', '[{"name":1,"parameters":{}}]',
             '[{"name":"f","parameters":{]}]', ' \n[{"name":"f","parameters":{}}]\t ']
    for whole in texts:
        for text in {whole[:k] for k in range(len(whole) + 1)} | {whole}:
            stream = ToolCallStream(ToolRequest(mode="required"))
            i = 0
            while i < len(text):
                j = i + rng.randint(1, 5)
                stream.feed(text[i:j])
                i = j
            assert stream.called() == _is_array_of_calls(text) == (required_calls(text) is not None), text


def test_reader_reports_names_before_arguments():
    reader = CallArrayReader(("parameters",))
    events = reader.feed('[{"name": "f", "parameters": {"a"')
    assert events == [("call", 0, "f"), ("args", 0, '{"a"')]
    assert reader.feed(': 1}}, {"parameters": [2') == [("args", 0, ": 1}")]  # held until the name
    assert reader.feed('], "name": "g"}]') == [("call", 1, "g"), ("args", 1, "[2]")]
    assert [[c.name, c.arguments] for c in reader.calls] == [["f", '{"a": 1}'], ["g", "[2]"]]
