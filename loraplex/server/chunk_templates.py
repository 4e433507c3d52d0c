"""A stream's plain text chunks written from a template: the SSE event of
``ResponseShaper.chunk(index, text, None)`` with no logprobs, tool calls or role, as bytes.

Such a chunk is all but one per streamed token, and everything in it but the choice's index, its
text and (with vLLM's ``continuous_usage_stats``) its token counts is fixed for the response:
the id, created, model and the null fields. Building the dict and encoding it whole took about
6 us a token here; the template writes the two or three varying values into text encoded once
(0.4 us). The bytes are ``sse_event(shaper.chunk(...))``'s exactly
(tests/server/test_chunk_templates.py holds them to it).
"""

from __future__ import annotations

from loraplex.server.json_encoding import compact_json, json_string


class TextChunkTemplate:
    """The text chunks of one response, made by ``ResponseShaper.text_event``."""

    def __init__(self, kind: str, head: dict, include_usage: bool):
        # the head's keys (id, object, created, model) in the dict's order, then the choice
        prefix = compact_json(head)[:-1] + ',"choices":[{"index":'
        self._before_text = ',"delta":{"content":' if kind == "chat" else ',"text":'
        nulls = ',"logprobs":null,"finish_reason":null,"stop_reason":null}]'
        self._prefix = "data: " + prefix
        self._after_text = "}" + nulls if kind == "chat" else nulls  # chat: the delta closes first
        self._end = ',"usage":null}\n\n' if include_usage else "}\n\n"

    def event(self, index: int, text: str) -> bytes:
        return (self._prefix + str(index) + self._before_text + json_string(text) + self._after_text
                + self._end).encode("utf-8")

    def event_with_usage(self, index: int, text: str, prompt_tokens: int, completion_tokens: int) -> bytes:
        """With the choice's usage so far (continuous usage stats)."""
        usage = (f',"usage":{{"prompt_tokens":{prompt_tokens},"completion_tokens":{completion_tokens},'
                 f'"total_tokens":{prompt_tokens + completion_tokens}}}}}\n\n')
        return (self._prefix + str(index) + self._before_text + json_string(text) + self._after_text
                + usage).encode("utf-8")
