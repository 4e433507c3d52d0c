"""The model-specific parsers of "auto" tool calls and of reasoning, on outputs in each model's
documented format (Qwen2.5/Qwen3/Hermes ``<tool_call>`` blocks, Llama 3.1/3.2 JSON calls, think
blocks of Qwen3 and DeepSeek-R1): the whole-output answer against a hand-written expectation,
and the streamed deltas, cut anywhere, joined against the whole-output answer."""

from __future__ import annotations

import json
import random

import pytest

from loraplex.server.chat_output import ChoiceOutput
from loraplex.server.call_reader import CallObjectReader
from loraplex.server.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser
from loraplex.server.tool_parsers import TOOL_PARSERS, get_tool_parser

HERMES, LLAMA = TOOL_PARSERS["hermes"], TOOL_PARSERS["llama3_json"]
QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]

# Qwen2.5's documented function-calling output (qwen.readthedocs.io, "Function Calling")
QWEN_TWO = ('<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": '
            '"San Francisco, CA, USA", "date": "2024-10-01"}}\n</tool_call>')


def whole(text, tools=None, reasoning=None, reason="stop", tail=""):
    return ChoiceOutput(reasoning, tools, tail).message(text, reason)


def calls_of(msg) -> list[tuple[str, object]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])]


# (parser, output, content, [(name, arguments as JSON)])
CASES = [
    # hermes: one call, several, text before / between / after, a call the output ended inside the tags
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', None,
     [("get_weather", {"city": "Oslo"})]),
    (HERMES, QWEN_TWO, None, [("get_current_temperature", {"location": "San Francisco, CA, USA"}),
                              ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"})]),
    (HERMES, 'Let me look that up.\n<tool_call>\n{"name": "f", "arguments": {"q": "<tool_call>}"}}\n</tool_call>',
     "Let me look that up.\n", [("f", {"q": "<tool_call>}"})]),
    (HERMES, '<tool_call>{"arguments": {}, "name": "g"}</tool_call> then <tool_call>{"name": "h", "arguments": [1]}'
     '</tool_call> done.', " then  done.", [("g", {}), ("h", [1])]),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),  # no </tool_call>
    (HERMES, '<tool_call>\n{"name": "f", "arguments": "x\\"y"}\n</tool_call>', None, [("f", 'x"y')]),
    # hermes: no call
    (HERMES, "The weather in Oslo is sunny. a < b, <tool_cal", "The weather in Oslo is sunny. a < b, <tool_cal", []),
    # llama3_json: bare, led by <|python_tag|>, several separated by ";", "arguments" instead of "parameters"
    (LLAMA, '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None,
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    (LLAMA, '<|python_tag|>{"name": "search", "parameters": {"query": "a; b"}}; {"name": "now", "arguments": {}}',
     None, [("search", {"query": "a; b"}), ("now", {})]),
    (LLAMA, ' {"name": "n", "parameters": 5}', None, [("n", 5)]),
    # llama3_json: text first is an answer, even with JSON in it
    (LLAMA, 'Use {"name": "x", "parameters": {}} like so.', 'Use {"name": "x", "parameters": {}} like so.', []),
    (LLAMA, "Paris is the capital of France.", "Paris is the capital of France.", []),
]

MALFORMED = [  # a call that does not parse: the whole output is content (vLLM's rule)
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>'),  # not JSON
    (HERMES, 'Sure.<tool_call>\n{"name": "f"}\n</tool_call>'),  # no arguments
    (HERMES, '<tool_call>{"name": 3, "arguments": {}}</tool_call>'),  # name not a string
    (HERMES, '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>'),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><tool_call>oops</tool_call>'),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"city": "Os'),  # cut short by max_tokens
    (LLAMA, '{"answer": 42}'),  # JSON, but no call
    (LLAMA, '{"name": "f", "parameters": {}, "arguments": {}}'),
    (LLAMA, '{"name": "f", "parameters": {"a": 1}'),
]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_whole_output(parser, text, content, calls):
    msg, reason = whole(text, parser)
    assert msg["content"] == content
    assert calls_of(msg) == calls
    assert reason == ("tool_calls" if calls else "stop")
    for call in msg.get("tool_calls", []):
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert call["function"]["arguments"] in text  # the model's own text of the value
    assert whole(text, parser, reason="length")[1] == "length"


@pytest.mark.parametrize("parser,text", MALFORMED)
def test_a_call_that_does_not_parse_leaves_the_output_as_content(parser, text):
    msg, reason = whole(text, parser)
    assert msg == {"role": "assistant", "content": text} and reason == "stop"


def test_tool_names_are_not_checked():
    """vLLM's parsers pass a name the request's tools do not hold through as a call."""
    msg, _ = whole('<tool_call>{"name": "not_a_tool", "arguments": {}}</tool_call>', HERMES)
    assert calls_of(msg) == [("not_a_tool", {})]


# --- streaming --------------------------------------------------------------------------------


def stream(out: ChoiceOutput, pieces) -> list[dict]:
    deltas = []
    for piece in pieces:
        deltas += out.feed(piece)
    return deltas + out.finish()


def joined(deltas) -> tuple:
    """content, reasoning and calls, as the openai client accumulates a stream."""
    calls: dict[int, list] = {}
    for d in deltas:
        for entry in d.get("tool_calls", []):
            if "id" in entry:
                assert entry["index"] == len(calls) and entry["function"]["arguments"] == ""
                calls[entry["index"]] = [entry["function"]["name"], ""]
            else:
                assert set(entry) == {"index", "function"}
                calls[entry["index"]][1] += entry["function"]["arguments"]
    content = "".join(d.get("content", "") for d in deltas) or None
    reasoning = "".join(d.get("reasoning", "") for d in deltas) or None
    return content, reasoning, [tuple(calls[k]) for k in sorted(calls)]


def expected(msg) -> tuple:
    content = msg["content"] or None
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])]
    return content, msg.get("reasoning"), calls


def splits(text: str, seed: int = 0):
    """Every cut in two, one character at a time, and random cuts."""
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(100):
        pieces, i = [], 0
        while i < len(text):
            j = i + rng.randint(1, 7)
            pieces.append(text[i:j])
            i = j
        yield pieces


# broken outputs in which no call is ever announced (no name is read): the held text comes out
STREAMED = [(p, t) for p, t, _, _ in CASES] + [(p, t) for p, t in MALFORMED if '"name": "' not in t]


@pytest.mark.parametrize("parser,text", STREAMED)
def test_streamed_deltas_join_into_the_whole_answer(parser, text):
    want = expected(whole(text, parser)[0])
    for pieces in splits(text):
        out = ChoiceOutput(None, parser)
        assert joined(stream(out, pieces)) == want, pieces
        assert out.finish_reason("stop") == ("tool_calls" if want[2] else "stop")


def test_content_streams_until_a_marker_could_begin():
    out = ChoiceOutput(None, HERMES)
    assert out.feed("Hello <tool") == [{"content": "Hello "}]
    assert out.feed("box> and <") == [{"content": "<toolbox> and "}]  # not a marker after all
    assert out.feed('tool_call>\n{"name": "f') == []  # a call: nothing until its name is complete
    head, args = out.feed('", "arguments": {"a"')
    assert head == {"tool_calls": [{"index": 0, "id": head["tool_calls"][0]["id"], "type": "function",
                                    "function": {"name": "f", "arguments": ""}}]}
    assert args == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}
    assert out.feed(': 1}}\n</tool_call>') == [{"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}]
    assert out.finish() == [] and out.finish_reason("stop") == "tool_calls"


def test_arguments_written_before_the_name_wait_for_it():
    reader = CallObjectReader(("arguments",))
    assert reader.feed('{"arguments": {"x": [1, "}"]}, ') == []
    assert reader.feed('"name": "late"}') == [("call", "late"), ("args", '{"x": [1, "}"]}')]
    assert reader.done and reader.check()


def test_a_call_announced_then_cut_short_stays_in_the_stream():
    """A stream cannot take back a call it announced: where the whole answer turns the output
    into content (its JSON was cut by max_tokens), the stream keeps the call (as vLLM's)."""
    text = '<tool_call>\n{"name": "f", "arguments": {"city": "Os'
    out = ChoiceOutput(None, HERMES)
    assert joined(stream(out, [text[:25], text[25:]]))[2] == [("f", '{"city": "Os')]
    assert out.finish_reason("length") == "length" and out.finish_reason("stop") == "tool_calls"
    assert whole(text, HERMES)[0]["content"] == text


def test_unknown_parser_names_list_the_known_ones():
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        get_tool_parser("nope")
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("nope")
    assert get_tool_parser(None) is None and get_reasoning_parser("qwen3") is QWEN3


# --- reasoning --------------------------------------------------------------------------------


# (parser, prompt tail, output, reasoning, content)
THINKING = [
    (QWEN3, "", "<think>\nThe user wants 2+2.\n</think>\n\nThe answer is 4.", "\nThe user wants 2+2.\n",
     "\n\nThe answer is 4."),
    (QWEN3, "", "The answer is 4.", None, "The answer is 4."),  # thinking disabled: no tags
    (QWEN3, "", "<think>\nStill thinking when max_tokens", "\nStill thinking when max_tokens", None),
    (QWEN3, "", "<think>\nDone.</think>", "\nDone.", None),
    (QWEN3, "<|im_start|>assistant\n<think>\n", "Reasoning here.</think>Answer.", "Reasoning here.", "Answer."),
    (QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n", "Plain <think> answer", None, "Plain <think> answer"),
    (R1, "<｜Assistant｜><think>\n", "Okay, so 2+2.\n</think>\n\n4", "Okay, so 2+2.\n", "\n\n4"),
    (R1, "", "<think>\nHmm.</think>4", "\nHmm.", "4"),  # a <think> the model writes itself
    (R1, "", "Cut short while thinking", "Cut short while thinking", None),
    (R1, "</think>", "Just the answer", None, "Just the answer"),
]


@pytest.mark.parametrize("parser,tail,text,reasoning,content", THINKING)
def test_reasoning_whole_and_streamed(parser, tail, text, reasoning, content):
    msg, reason = whole(text, reasoning=parser, tail=tail)
    assert (msg["reasoning"], msg["reasoning_content"], msg["content"]) == (reasoning, reasoning, content)
    assert reason == "stop" and "tool_calls" not in msg
    for pieces in splits(text):
        assert joined(stream(ChoiceOutput(parser, None, tail), pieces)) == (content, reasoning, [])


def test_reasoning_then_tool_calls():
    """The tool-call parser reads the content part only: a call written while thinking is
    reasoning text."""
    text = ('<think>\nI could write <tool_call>{"name": "no", "arguments": {}}</tool_call> here.\n</think>\n\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    msg, reason = whole(text, HERMES, QWEN3)
    assert msg["reasoning"].startswith("\nI could write <tool_call>") and msg["content"] is None
    assert calls_of(msg) == [("get_weather", {"city": "Oslo"})] and reason == "tool_calls"
    for pieces in splits(text):
        assert joined(stream(ChoiceOutput(QWEN3, HERMES), pieces)) == expected(msg)


def test_parallel_tool_calls_false_keeps_the_first_call():
    """vLLM (vllm-project/vllm#26233) answers only the first call, streamed or not."""
    msg, reason = ChoiceOutput(None, HERMES, max_calls=1).message(QWEN_TWO, "stop")
    assert calls_of(msg) == [("get_current_temperature", {"location": "San Francisco, CA, USA"})]
    assert reason == "tool_calls" and msg["content"] is None
    for pieces in splits(QWEN_TWO):
        assert joined(stream(ChoiceOutput(None, HERMES, max_calls=1), pieces)) == expected(msg)
