"""A stream's plain text chunks come from a template (``ResponseShaper.text_event``) and every
other body from a prebuilt encoder (``json_encoding.compact_json``): both must write the bytes
the dict path wrote, ``json.dumps(..., separators=(",", ":"), ensure_ascii=False)`` of
``ResponseShaper.chunk``'s dict, for every text, index, response kind and usage setting."""

from __future__ import annotations

import json
import math
import random

import pytest

from loraplex.server.json_encoding import compact_json
from loraplex.server.shapes import ResponseShaper


def reference_event(obj: dict) -> bytes:
    """The SSE event as the server wrote it before the template (the stdlib's own call)."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n\n"


TEXTS = [
    "", " the", "caf\u00e9", "\u4f60\u597d", "\U0001f600 emoji", 'say "hi"', "back\\slash", "tab\there",
    "new\nline", "\r\n", "\x00\x01\x1f\x7f", "\u2028\u2029", "</script>", "\ufffd", "a" * 1000, "{}[],:",
]
MODELS = ["bench-model", "t\u00e9nant/ad\u00e4pter", 'quo"te\\model']


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("model", MODELS)
def test_text_event_is_the_chunk_dict_encoded(kind, include_usage, model):
    shaper = ResponseShaper(kind, model, None, include_usage=include_usage, role="assistant")
    for index in (0, 1, 7, 1234):
        for text in TEXTS:
            assert shaper.text_event(index, text) == reference_event(shaper.chunk(index, text, None)), (index, text)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_text_event_with_continuous_usage(kind):
    shaper = ResponseShaper(kind, "m", None, include_usage=True, response_id="chatcmpl-x")
    shaper.track_usage([5, 17, 0])
    for step in range(3):
        for index, text in enumerate(["a", "\u00e9\U0001f600", ""]):
            shaper.count_tokens(index, step + index)
            expected = reference_event(shaper.chunk(index, text, None))
            assert json.loads(expected[6:])["usage"]["completion_tokens"] >= 0
            assert shaper.text_event(index, text) == expected


def test_a_lone_surrogate_fails_as_it_did():
    """No UTF-8 text holds one: the dict path raised UnicodeEncodeError, so does the template."""
    shaper = ResponseShaper("chat", "m", None)
    with pytest.raises(UnicodeEncodeError):
        reference_event(shaper.chunk(0, "a\ud800", None))
    with pytest.raises(UnicodeEncodeError):
        shaper.text_event(0, "a\ud800")


def _random_value(rng: random.Random, depth: int = 0):
    scalars = [None, True, False, 0, -1, 2**70, 1.5, -0.0, 1e300, 5e-324, math.inf, -math.inf,
               "", "x", "\u00e9\n\"\\", "\U0001f600", "\x00"]
    if depth > 3 or rng.random() < 0.4:
        return rng.choice(scalars)
    if rng.random() < 0.5:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["id", "k\u00e9y", "", "a\"b", "usage", "\U0001f600"]) + str(i): _random_value(rng, depth + 1)
            for i in range(rng.randrange(4))}


def test_compact_json_writes_what_json_dumps_writes():
    rng = random.Random(0)
    for _ in range(2000):
        value = _random_value(rng)
        assert compact_json(value) == json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    nan = compact_json({"x": math.nan})
    assert nan == json.dumps({"x": math.nan}, separators=(",", ":"), ensure_ascii=False) == '{"x":NaN}'


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_other_chunks_through_the_encoder(kind):
    """Role, finish, logprobs, tool-call and usage chunks keep going through the dict path."""
    shaper = ResponseShaper(kind, "m\u00e9", None, include_usage=True)
    logprobs = {"content": [{"token": "\u00e9", "logprob": -0.25, "bytes": [195, 169], "top_logprobs": []}]}
    calls = [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]
    bodies = [shaper.chunk(0, "", None, role=True), shaper.chunk(1, "x", "stop", logprobs),
              shaper.chunk(0, None, None, tool_calls=calls), shaper.chunk(2, None, "length"),
              shaper.usage_chunk(12, 34)]
    for body in bodies:
        assert compact_json(body) == json.dumps(body, separators=(",", ":"), ensure_ascii=False)
