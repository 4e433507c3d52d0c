"""Structured output after reasoning: with ``--reasoning-parser``, a chat request kept to a
constraint (``response_format``, ``structured_outputs``, ``guided_*``, a named or ``"required"``
tool choice) lets the model reason freely and keeps only its answer, after ``</think>``, to the
constraint, as vLLM does.

The server hands the engine a ``ReasoningBoundary`` (the tags' token ids from the tokenizer, and
where the output starts, decided from the prompt by the same rule the reasoning splitter reads
the output with), so the grammar starts exactly where the splitter's content does. The answer is
then read as any parsed chat answer: reasoning to ``reasoning`` / ``reasoning_content``, the rest
to ``content`` or, for a tool choice, to the call's arguments. An output that ends inside its
reasoning (``max_tokens``, which counts the reasoning tokens) has reasoning and no content (null),
and for a tool choice no call.

Chat (and the Responses API, which runs it) only: completions keep the constraint from the first
token, their text being the raw output.
"""

from __future__ import annotations

from loraplex.server import tool_calls
from loraplex.server.chat_output import REASONING_FIELDS, prompt_tail
from loraplex.server.reasoning_parsers import ReasoningSplitter


def set_boundary(ctx, req, prompt_ids: list[list[int]]) -> None:
    """Give the request's sampling params the boundary the grammar starts after, when its
    output is kept to a constraint and the server has a reasoning parser (else nothing)."""
    parser = ctx.reasoning_parser
    if req.kind != "chat" or parser is None or req.params.structured_outputs is None:
        return

    def encode(text: str) -> list[int]:
        return list(ctx.tokenizer(text, add_special_tokens=False)["input_ids"])

    req.params.reasoning_boundary = parser.boundary(prompt_tail(ctx.tokenizer, prompt_ids[0]), encode)


def splitter(run) -> ReasoningSplitter | None:
    """A reader of one choice's reasoning, for a tool choice kept to its arguments after
    reasoning; None when the output is the arguments from its first token."""
    if run.req.params.reasoning_boundary is None or run.ctx.reasoning_parser is None:
        return None
    return run.ctx.reasoning_parser.splitter(prompt_tail(run.ctx.tokenizer, run.prompt_ids[0]))


def tool_message(run, text: str) -> tuple[dict, bool]:
    """The assistant message of a whole tool-choice output and whether it holds calls: with
    reasoning, the reasoning fields plus the calls read from the content after it (none when
    the output ended inside its reasoning)."""
    split = splitter(run)
    if split is None:
        return tool_calls.message(run.req.tools, text)
    parts = split.feed(text) + split.finish()
    reasoning = "".join(piece for kind, piece in parts if kind == "reasoning") or None
    content = "".join(piece for kind, piece in parts if kind == "content")
    if content:
        msg, called = tool_calls.message(run.req.tools, content)
    else:
        msg, called = {"role": "assistant", "content": None}, False
    msg.update({field: reasoning for field in REASONING_FIELDS})
    return msg, called


def tool_deltas(split: ReasoningSplitter | None, stream: tool_calls.ToolCallStream, text: str,
                final: bool) -> list[dict]:
    """One engine delta of a tool-choice output as chat deltas, in order: ``{"reasoning": s}``
    and ``{"tool_calls": [entry]}`` (a named call's header comes with its first argument)."""
    parts = [("content", text)] if split is None else split.feed(text) + (split.finish() if final else [])
    out: list[dict] = []
    for kind, piece in parts:
        if kind == "reasoning":
            out.append({"reasoning": piece})
        else:
            out += [{"tool_calls": [entry]} for entry in stream.feed(piece)]
    return out
