"""OpenAI's Responses API (``POST /v1/responses``) over fake engines, read by the installed openai
client as the reference for the shapes: the ``response`` object whole and as semantic events
(the deltas joined equal the whole answer for the same engine output), the same text and usage
as chat completions, ``incomplete`` on ``max_output_tokens``, function calls (a round trip of
``function_call`` / ``function_call_output`` items rendered by a chat template), reasoning
items, and ``text.format`` reaching the engine as a constraint."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.fakes import expected_text
from tests.server.scripted_engine import ScriptedEngine
from tests.server.test_auto_tools_fake import CALL_TEXT, PIECES, THINK, QwenStyleTokenizer

PLACE = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "weather", "parameters": PLACE}]
ANSWER = ["It is ", "sunny ", "in Oslo."]


def _client(srv, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.make_tenant(tenant), max_retries=0)


def _whole_items(resp) -> list[tuple]:
    """The output items as (type, text or (name, arguments)), ids and statuses left out."""
    out = []
    for item in resp.output:
        if item.type == "message":
            out.append(("message", "".join(p.text for p in item.content)))
        elif item.type == "reasoning":
            out.append(("reasoning", "".join(p.text for p in item.content)))
        else:
            out.append(("function_call", (item.name, item.arguments)))
    return out


def _streamed(events) -> tuple[list[tuple], object]:
    """The items rebuilt from the deltas alone (as a client renders a stream), and the final
    response; checks the events' own bookkeeping on the way."""
    events = list(events)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    items: dict[int, list] = {}
    for e in events:
        if e.type == "response.output_item.added":
            assert e.output_index == len(items) and e.item.status == "in_progress"
            kind = e.item.type
            items[e.output_index] = [kind, (e.item.name, "") if kind == "function_call" else ""]
        elif e.type in ("response.output_text.delta", "response.reasoning_text.delta"):
            items[e.output_index][1] += e.delta
        elif e.type == "response.function_call_arguments.delta":
            name, args = items[e.output_index][1]
            items[e.output_index][1] = (name, args + e.delta)
        elif e.type == "response.output_text.done":
            assert e.text == items[e.output_index][1]
        elif e.type == "response.function_call_arguments.done":
            assert e.arguments == items[e.output_index][1][1]
        elif e.type == "response.output_item.done":
            assert e.item.type == items[e.output_index][0] and e.item.status in ("completed", "incomplete")
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete")
    rebuilt = [tuple(items[k]) for k in sorted(items)]
    assert _whole_items(final.response) == rebuilt  # the final object holds what the deltas built
    return rebuilt, final.response


def test_text_matches_chat_completions_and_the_engine(server_factory):
    """The input rendered as chat messages (instructions first): the same prompt, text and usage
    as chat completions; FakeEngine runs to max tokens, so the answer is incomplete."""
    srv = server_factory()
    client = _client(srv, "resp")
    resp = client.responses.create(model="fake-model", instructions="be brief", input="hello there",
                                   max_output_tokens=6, metadata={"run": "a"}, user="u1", store=True)
    chat = client.chat.completions.create(model="fake-model", max_tokens=6, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}])
    prompt = srv.engine.prompts_seen[srv.engine.started[0][0]]
    assert prompt == srv.engine.prompts_seen[srv.engine.started[1][0]]
    assert resp.output_text == chat.choices[0].message.content == expected_text(srv.engine.tokenizer, prompt,
                                                                                None, None, 6)
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == "fake-model"
    assert (resp.status, resp.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    (item,) = resp.output
    assert (item.type, item.role, item.status) == ("message", "assistant", "incomplete")
    assert item.id.startswith("msg_") and item.content[0].type == "output_text"
    u = resp.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (
        chat.usage.prompt_tokens, 6, chat.usage.prompt_tokens + 6)
    assert (resp.metadata, resp.user, resp.instructions, resp.max_output_tokens) == ({"run": "a"}, "u1", "be brief", 6)
    assert "output_text" not in resp.model_dump(exclude_unset=True)  # the client computes it
    streamed, final = _streamed(client.responses.create(model="fake-model", instructions="be brief",
                                                        input="hello there", max_output_tokens=6, stream=True))
    assert streamed == [("message", resp.output_text)]
    assert final.status == "incomplete" and final.usage.output_tokens == 6


def test_completed_whole_and_streamed_and_the_sse_lines(server_factory):
    srv = server_factory(ScriptedEngine(ANSWER, ANSWER, ANSWER))
    client = _client(srv, "resp")
    body = {"model": "fake-model", "input": [{"role": "user", "content": [{"type": "input_text", "text": "Oslo?"}]}]}
    resp = client.responses.create(**body)
    assert (resp.status, resp.incomplete_details, resp.output_text) == ("completed", None, "It is sunny in Oslo.")
    assert resp.output[0].status == "completed" and resp.usage.output_tokens == 3
    streamed, final = _streamed(client.responses.create(**body, stream=True))
    assert streamed == _whole_items(resp) and final.status == "completed"
    # the wire: every event an SSE "event:" line naming its type, then its data; no [DONE]
    with srv.tenant_client(client.api_key) as c:
        text = c.post("/t/resp/v1/responses", json={**body, "stream": True}).text
    blocks = [b.split("\n") for b in text.strip().split("\n\n")]
    assert all(b[0] == "event: " + json.loads(b[1][len("data: "):])["type"] for b in blocks)
    types = [b[0][len("event: "):] for b in blocks]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * 3,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]


def test_function_call_round_trip_rendered_by_the_template(server_factory):
    """An agent loop: the answer's function_call item sent back with a function_call_output, as
    the Agents SDK sends them, reach the chat template as a tool call and its tool result."""
    engine = ScriptedEngine(PIECES, PIECES, ANSWER, max_model_len=1024)
    engine.tokenizer = QwenStyleTokenizer()
    srv = server_factory(engine, tool_call_parser="hermes")
    client = _client(srv, "agent")
    user = [{"role": "user", "content": "Weather in Oslo?"}]
    first = client.responses.create(model="fake-model", input=user, tools=TOOLS)
    assert _whole_items(first) == [("message", "Let me check.\n"),
                                   ("function_call", ("get_weather", '{"city": "Oslo"}'))]
    call = first.output[1]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    assert first.status == "completed"
    streamed, _ = _streamed(client.responses.create(model="fake-model", input=user, tools=TOOLS, stream=True))
    assert streamed == _whole_items(first)
    history = user + [item.model_dump(exclude_none=True) for item in first.output]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "sunny"})
    second = client.responses.create(model="fake-model", input=history, tools=TOOLS)
    assert second.output_text == "It is sunny in Oslo."
    prompt = engine.tokenizer.rendered[-1]
    assert prompt.startswith("<|im_start|>system\n<tools>\nget_weather\n</tools>")
    assert ('<|im_start|>assistant\nLet me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Oslo"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n'
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in prompt


def test_named_and_required_tool_choice_keep_the_output_to_the_arguments(server_factory):
    args = ['{"city": ', '"Oslo"}']
    required = ['[{"name": "get_weather", "parameters": ', '{"city": "Rome"}}]']
    srv = server_factory(ScriptedEngine(args, args, required, required))
    client = _client(srv, "tools")
    named = {"type": "function", "name": "get_weather"}
    resp = client.responses.create(model="fake-model", input="Oslo?", tools=TOOLS, tool_choice=named)
    assert _whole_items(resp) == [("function_call", ("get_weather", '{"city": "Oslo"}'))]
    assert srv.engine.params_seen[srv.engine.started[-1][0]].structured_outputs.json == PLACE
    assert resp.tool_choice.name == "get_weather"  # echoed as sent
    streamed, _ = _streamed(client.responses.create(model="fake-model", input="Oslo?", tools=TOOLS,
                                                    tool_choice=named, stream=True))
    assert streamed == _whole_items(resp)
    resp = client.responses.create(model="fake-model", input="Rome?", tools=TOOLS, tool_choice="required")
    assert _whole_items(resp) == [("function_call", ("get_weather", '{"city": "Rome"}'))]
    streamed, _ = _streamed(client.responses.create(model="fake-model", input="Rome?", tools=TOOLS,
                                                    tool_choice="required", stream=True))
    assert streamed == _whole_items(resp)


def test_reasoning_item_whole_and_streamed(server_factory):
    srv = server_factory(ScriptedEngine(THINK, THINK), reasoning_parser="qwen3")
    client = _client(srv, "think")
    resp = client.responses.create(model="fake-model", input="Oslo?")
    assert _whole_items(resp) == [("reasoning", "\nThe user asks about Oslo.\n"), ("message", "\n\nIt is sunny.")]
    assert resp.output[0].id.startswith("rs_") and resp.output[0].summary == []
    assert resp.output_text == "\n\nIt is sunny."
    streamed, _ = _streamed(client.responses.create(model="fake-model", input="Oslo?", stream=True))
    assert streamed == _whole_items(resp)


def test_reasoning_and_call_sent_back_reach_the_template_as_one_turn(server_factory):
    text = ["<think>\nNeed the weather.\n</think>\n\n", CALL_TEXT]
    engine = ScriptedEngine(text, ANSWER, max_model_len=1024)
    seen = []
    render = engine.tokenizer.apply_chat_template

    def spy(messages, **kw):
        seen.append(messages)
        return render(messages, **kw)

    engine.tokenizer.apply_chat_template = spy
    srv = server_factory(engine, tool_call_parser="hermes", reasoning_parser="qwen3")
    client = _client(srv, "loop")
    first = client.responses.create(model="fake-model", input="Oslo?", tools=TOOLS)
    assert [i.type for i in first.output] == ["reasoning", "function_call"]
    history = [{"role": "user", "content": "Oslo?"}, *[i.model_dump(exclude_none=True) for i in first.output],
               {"type": "function_call_output", "call_id": first.output[1].call_id, "output": "sunny"}]
    client.responses.create(model="fake-model", input=history, tools=TOOLS)
    assistant = seen[-1][1]
    assert assistant["role"] == "assistant" and assistant["reasoning"] == "\nNeed the weather.\n"
    assert assistant["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert assistant["tool_calls"][0]["id"] == first.output[1].call_id
    assert seen[-1][2] == {"role": "tool", "tool_call_id": first.output[1].call_id, "content": "sunny"}


@pytest.mark.parametrize("fmt,expected", [
    ({"type": "json_schema", "name": "place", "schema": PLACE, "strict": True}, {"json": PLACE}),
    ({"type": "json_object"}, {"json_object": True}),
    ({"type": "text"}, None),
])
def test_text_format_reaches_the_engine_as_a_constraint(server_factory, fmt, expected):
    srv = server_factory(ScriptedEngine(['{"city": "Oslo"}']))
    client = _client(srv, "fmt")
    resp = client.responses.create(model="fake-model", input="Oslo?", text={"format": fmt})
    constraint = srv.engine.params_seen[srv.engine.started[-1][0]].structured_outputs
    if expected is None:
        assert constraint is None
    else:
        assert {k: getattr(constraint, k) for k in expected} == expected
    assert resp.output_text == '{"city": "Oslo"}' and resp.text.format.type == fmt["type"]


def test_sampling_fields_reach_the_engine_and_the_tenant_path(server_factory):
    srv = server_factory()
    key = srv.make_tenant("paths")
    with srv.tenant_client(key) as c:
        r = c.post("/t/paths/v1/responses", json={"model": "fake-model", "input": "hi", "temperature": 0.3,
                                                   "top_p": 0.5, "max_output_tokens": 3, "parallel_tool_calls": False})
        assert r.status_code == 200, r.text
        params = srv.engine.params_seen[srv.engine.started[-1][0]]
        assert (params.temperature, params.top_p, params.max_tokens, params.n) == (0.3, 0.5, 3, 1)
        body = r.json()
        assert (body["temperature"], body["top_p"], body["parallel_tool_calls"], body["store"]) == (0.3, 0.5, False,
                                                                                                  False)
        # vLLM's extra sampling fields mean what they mean on chat (and are checked there)
        r = c.post("/t/paths/v1/responses", json={"model": "fake-model", "input": "hi", "top_k": 7, "seed": 11,
                                                   "min_p": 0.1, "stop": ["zz"], "repetition_penalty": 1.2,
                                                   "cache_salt": "s1"})
        assert r.status_code == 200, r.text
        rid = srv.engine.started[-1][0]
        params = srv.engine.params_seen[rid]
        assert (params.top_k, params.seed, params.min_p, params.stop, params.repetition_penalty) == (
            7, 11, 0.1, ["zz"], 1.2)
        assert srv.engine.salts_seen[rid] == '["tenant", "paths", "s1"]'
        bad = c.post("/t/paths/v1/responses", json={"model": "fake-model", "input": "hi", "top_k": "many"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_k"
        # another tenant's path: refused as chat completions refuse it, before any model work
        before = len(srv.engine.started)
        refused = c.post("/t/other/v1/responses", json={"model": "fake-model", "input": "hi"})
        chat = c.post("/t/other/v1/chat/completions", json={"model": "fake-model", "messages": [
            {"role": "user", "content": "hi"}]})
        assert refused.status_code == chat.status_code == 401 and refused.json() == chat.json()
        assert len(srv.engine.started) == before


class _FailingEngine(ScriptedEngine):
    """Writes its first piece, then fails."""

    async def generate(self, prompt, params, request_id=None, adapter=None, cache_salt=None, priority=0,
                       tenant=None, tenant_weight=1.0):
        async for out in super().generate(prompt, params, request_id, adapter, cache_salt):
            yield out
            raise RuntimeError("the engine broke")


def test_an_engine_failure_mid_stream_is_response_failed(server_factory):
    srv = server_factory(_FailingEngine(ANSWER))
    client = _client(srv, "fail")
    events = list(client.responses.create(model="fake-model", input="Oslo?", stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    last = events[-1]
    assert last.type == "response.failed" and last.response.status == "failed"
    assert last.response.error.code == "server_error" and last.response.error.message
    assert [(i.type, i.status) for i in last.response.output] == [("message", "incomplete")]
    assert srv.app.state.ctx.limiter.in_flight() == 0  # the tenant slot given back


def test_input_items_as_chat_messages():
    """Parallel calls sent back are one assistant turn with two tool_calls, each answered by a
    tool message; a reasoning item with no answer after it is an assistant turn of its own."""
    from loraplex.chat_content import shape_messages
    from loraplex.server.responses_protocol import parse_responses_request

    call = {"type": "function_call", "name": "get_weather"}
    items = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "Oslo and Rome?"},
             {**call, "call_id": "c1", "arguments": '{"city": "Oslo"}'},
             {**call, "call_id": "c2", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
             {"role": "user", "content": "and Paris?"}]
    req = parse_responses_request({"model": "m", "instructions": "sys", "input": items})
    # as a string-content template gets them (loraplex/chat_content.py)
    assert [(m["role"], m["content"]) for m in shape_messages(req.messages, "string")] == [
        ("system", "sys"), ("system", "be brief"), ("user", "Oslo and Rome?"), ("assistant", ""),
        ("tool", "sunny"), ("tool", "rain"), ("assistant", ""), ("user", "and Paris?")]
    assert [(c["id"], c["function"]["arguments"]) for c in req.messages[3]["tool_calls"]] == [
        ("c1", {"city": "Oslo"}), ("c2", {"city": "Rome"})]
    assert [m.get("tool_call_id") for m in req.messages[4:6]] == ["c1", "c2"]
    assert req.messages[6]["reasoning"] == "hm" and "tool_calls" not in req.messages[6]
