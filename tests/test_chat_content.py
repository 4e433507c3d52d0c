"""Message content in the shape vLLM hands a chat template (vllm/entrypoints/chat_utils.py): text
parts joined with "\\n" for a string template, a list of text parts for an "openai" one, a string
wrapped into one part there, left-out content as "" / [], a tool message always a string."""

from __future__ import annotations

import pytest

from loraplex.chat_content import check_messages, shape_content, shape_messages
from loraplex.sampling_params import InvalidRequestError

PARTS = [{"type": "text", "text": " a "}, {"type": "text", "text": "b"}, {"type": "text", "text": ""}]


def test_string_format_joins_text_parts_with_a_newline():
    assert shape_content("user", PARTS, "string") == " a \nb\n"
    assert shape_content("user", "as sent", "string") == "as sent"
    assert shape_content("user", [], "string") == ""
    assert shape_content("assistant", None, "string") == ""


def test_openai_format_passes_text_parts_and_wraps_a_string():
    assert shape_content("user", PARTS, "openai") == PARTS
    assert shape_content("user", "as sent", "openai") == [{"type": "text", "text": "as sent"}]
    assert shape_content("assistant", None, "openai") == []


def test_openai_format_drops_keys_a_text_part_does_not_have():
    # the template sees {"type", "text"} only, as vLLM rebuilds each text part
    assert shape_content("user", [{"type": "text", "text": "x", "cache_control": {}}], "openai") == [
        {"type": "text", "text": "x"}]


@pytest.mark.parametrize("fmt", ["string", "openai"])
def test_a_tool_message_is_always_a_string(fmt):
    assert shape_content("tool", PARTS, fmt) == " a \nb\n"
    assert shape_content("tool", "sunny", fmt) == "sunny"


def test_shape_messages_keeps_everything_but_content():
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}]
    messages = [{"role": "user", "content": PARTS, "name": "ann"},
                {"role": "assistant", "content": None, "tool_calls": calls, "reasoning": "hm"}]
    shaped = shape_messages(messages, "string")
    assert shaped == [{"role": "user", "content": " a \nb\n", "name": "ann"},
                      {"role": "assistant", "content": "", "tool_calls": calls, "reasoning": "hm"}]
    assert messages[0]["content"] is PARTS  # the request's own messages are not changed


@pytest.mark.parametrize("bad", [
    [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}],
    [{"type": "text", "text": 3}], ["plain string part"], [{"text": "no type"}],
])
def test_a_part_that_is_not_text_is_refused(bad):
    with pytest.raises(InvalidRequestError) as info:
        check_messages([{"role": "user", "content": "fine"}, {"role": "user", "content": bad}])
    assert info.value.param == "messages[1].content"
    with pytest.raises(InvalidRequestError):
        shape_content("user", bad, "openai")


def test_content_of_another_type_is_refused_and_left_out_content_is_not():
    with pytest.raises(InvalidRequestError, match="string or a list of text parts"):
        check_messages([{"role": "user", "content": {"text": "x"}}])
    with pytest.raises(InvalidRequestError, match="message object"):
        check_messages(["hello"])
    check_messages([{"role": "assistant", "tool_calls": []}, {"role": "user", "content": PARTS}])
