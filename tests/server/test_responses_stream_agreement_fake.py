"""``POST /v1/responses``: the streamed events against the whole answer for the same engine
output, where the model writes text around its tool calls (hermes allows text before, between
and after calls) and reasoning, cut at awkward places: the items of both come in the order the
model wrote them, with the same texts; sequence numbers, output indices and every ``.done``
event's text are checked by ``_streamed``."""

from __future__ import annotations

import pytest

from tests.server.scripted_engine import ScriptedEngine
from tests.server.test_auto_tools_fake import CALL_TEXT
from tests.server.test_responses_fake import TOOLS, _client, _streamed, _whole_items

ROME = CALL_TEXT.replace("Oslo", "Rome")


def _cut(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


CASES = [
    # text after the call
    ("hermes", None, "Checking.\n" + CALL_TEXT + "\nDone."),
    ("hermes", None, "Checking." + CALL_TEXT + "\n"),
    ("hermes", None, CALL_TEXT + " and that is all."),
    # text between two calls
    ("hermes", None, CALL_TEXT + " then " + ROME),
    ("hermes", None, CALL_TEXT + "\n\n" + ROME + "\n"),
    # reasoning, then text and calls
    ("hermes", "qwen3", "<think>\nhm\n</think>\n\n" + CALL_TEXT + " ok"),
    ("hermes", "qwen3", "<think>\nhm\n</think>\n\nSure." + CALL_TEXT),
    ("llama3_json", "deepseek_r1", 'hm</think>{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
]


@pytest.mark.parametrize("size", [1, 3, 7])
@pytest.mark.parametrize("tools,reasoning,text", CASES, ids=[str(i) for i in range(len(CASES))])
def test_streamed_items_are_the_whole_answers(server_factory, tools, reasoning, text, size):
    pieces = _cut(text, size)
    srv = server_factory(ScriptedEngine(pieces, pieces, max_model_len=4096), tool_call_parser=tools,
                         reasoning_parser=reasoning)
    client = _client(srv, "order")
    whole = client.responses.create(model="fake-model", input="Oslo?", tools=TOOLS)
    streamed, final = _streamed(client.responses.create(model="fake-model", input="Oslo?", tools=TOOLS, stream=True))
    assert streamed == _whole_items(whole)
    assert (final.status, [i.status for i in final.output]) == (whole.status, [i.status for i in whole.output])
