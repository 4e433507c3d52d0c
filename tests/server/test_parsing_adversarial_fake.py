"""Adversarial text where the server reads JSON it did not write: a model's tool-call output and
the tool calls a client sends back. JSON nested deeper than the interpreter's recursion limit
makes ``json.loads`` raise RecursionError, not ValueError; such text is text that is not a
call (output) or arguments that are no JSON object (input, read as ``{}`` as vLLM does), never
a 500 or a stream cut short."""

from __future__ import annotations

import pytest

from loraplex.server.call_reader import CallObjectReader
from loraplex.server.tool_calls import template_tool_calls
from tests.server.scripted_engine import ScriptedEngine
from tests.server.test_auto_tools_fake import CHAT, PATH, _join, _sse, _whole

DEEP = "[" * 50_000 + "]" * 50_000  # far past sys.getrecursionlimit()


def test_deep_arguments_read_as_no_call_and_no_object():
    reader = CallObjectReader(("arguments",))
    reader.feed('{"name": "f", "arguments": ' + DEEP + "}")
    assert reader.done and not reader.check()
    (call,) = template_tool_calls([{"id": "c", "type": "function", "function": {"name": "f", "arguments": DEEP}}],
                                  "messages[1].tool_calls")
    assert call["function"]["arguments"] == {}


@pytest.fixture
def serve(server_factory):
    def make(**settings):
        srv = server_factory(ScriptedEngine(max_model_len=10**6), **settings)
        return srv, srv.tenant_client(srv.make_tenant("deep"))
    return make


def test_deep_tool_call_arguments_sent_back_are_served(serve):
    srv, c = serve()
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}
    srv.engine.push("ok")
    r = c.post(PATH, json={"model": "fake-model", "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"}]})
    assert r.status_code == 200, r.text
    srv.engine.push("ok")
    r = c.post("/v1/responses", json={"model": "fake-model", "input": [
        {"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP},
        {"type": "function_call_output", "call_id": "c1", "output": "done"}]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("parser,text", [
    ("hermes", '<tool_call>{"name": "f", "arguments": ' + DEEP + "}</tool_call>"),
    ("llama3_json", '{"name": "f", "parameters": ' + DEEP + "}"),
])
def test_deep_call_output_is_content_whole_and_a_finished_stream(serve, parser, text):
    """The whole answer: not a call, so the text is the content. The stream announced the call
    before its arguments could be read (documented: it cannot be taken back), and must still
    finish."""
    srv, c = serve(tool_call_parser=parser)
    srv.engine.push(text[:40], text[40:])
    r = c.post(PATH, json=CHAT)
    assert r.status_code == 200, r.text
    assert _whole(r.json()["choices"][0]) == (text, None, [], ["stop"])
    srv.engine.push(text[:40], text[40:])
    content, _, calls, reasons = _join(_sse(c.post(PATH, json={**CHAT, "stream": True})))
    assert reasons == ["tool_calls"] and [name for name, _ in calls] == ["f"]


def test_enormous_outputs_are_read_in_linear_time():
    """A str grown by ``+=`` (an attribute or a list item, where CPython cannot grow it in place)
    is copied whole each time: an output of 400k characters took seconds of the event loop, four
    times as long for each doubling. Read whole, streamed by the tool-call reader, or shaped as
    Responses events, it now takes a fraction of a second (the bound leaves a wide margin)."""
    import time

    from loraplex.server.responses_shapes import EventStream
    from loraplex.server.tool_parsers import HermesParser, ToolCallStreamer

    n = 400_000
    call = '{"name": "f", "arguments": {"a": "' + "x" * n + '"}}'
    start = time.monotonic()
    reader = CallObjectReader(("arguments",))
    reader.feed(call)
    assert reader.check() and reader.arguments == '{"a": "' + "x" * n + '"}'
    for text in ("<tool_call>" + call + "</tool_call>", "<tool_call>no call</tool_call>" + "y" * n):
        streamer = ToolCallStreamer(HermesParser())
        for i in range(0, len(text), 4):
            streamer.feed(text[i:i + 4])
        streamer.finish()
    events = EventStream("resp_1", 0, "m", {})
    for _ in range(n // 4):
        events.feed({"choices": [{"delta": {"content": "abcd"}, "finish_reason": None}]})
    assert events.finish(1, n // 4)[-1]["response"]["output"][0]["content"][0]["text"] == "abcd" * (n // 4)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("reasoning,tools", [("qwen3", None), ("deepseek_r1", "hermes"), (None, "llama3_json")])
def test_a_model_writing_only_newlines_is_read_in_linear_time(reasoning, tools):
    """A degenerate adapter that writes newlines until ``max_tokens``: while a ``<think>`` or a
    call could still start the output, the parsers held the whitespace and scanned all of it
    again at every piece (100k characters: about 12 s of the event loop); the content is the
    same, read in a fraction of a second."""
    import time

    from loraplex.server.chat_output import ChoiceOutput
    from loraplex.server.reasoning_parsers import get_reasoning_parser
    from loraplex.server.responses_shapes import EventStream
    from loraplex.server.tool_parsers import get_tool_parser

    n = 100_000
    start = time.monotonic()
    out = ChoiceOutput(get_reasoning_parser(reasoning), get_tool_parser(tools))
    events = EventStream("resp_1", 0, "m", {})
    joined = []
    for _ in range(n // 4):
        for delta in out.feed("\n\n\n\n"):
            joined.append(delta.get("content") or delta.get("reasoning"))
            events.feed({"choices": [{"delta": delta, "finish_reason": None}]})
    for delta in out.finish():
        joined.append(delta.get("content") or delta.get("reasoning"))
        events.feed({"choices": [{"delta": delta, "finish_reason": None}]})
    events.finish(1, n // 4)
    assert "".join(joined) == "\n" * n and len(events.items) == 1
    assert time.monotonic() - start < 3
