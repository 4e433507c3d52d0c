"""A chat answer read by the server's parsers: reasoning (``--reasoning-parser``) and, for
``tool_choice: "auto"``, tool calls (``--tool-call-parser``), whole or as stream deltas.

The reasoning goes to the message's ``reasoning`` field, which vLLM sends since
vllm-project/vllm#27752, and to ``reasoning_content`` too, the field vLLM sent before (removed in
vllm-project/vllm#33402) and that DeepSeek's API, LiteLLM and the Vercel AI SDK read; streamed as
``delta.reasoning`` / ``delta.reasoning_content``. The content part is what the tool-call parser
reads.

A request whose output is kept to a constraint (``response_format``, ``structured_outputs``,
``guided_*``) is read for reasoning only, when the server has a reasoning parser: the engine
holds the constraint after the reasoning ends (reasoned_constraints.py), and the content is the
constrained answer. Without one, the constraint holds from the first token and the text is the
answer. A named or ``"required"`` tool choice is read by tool_calls.py (and
reasoned_constraints.py for its reasoning).
"""

from __future__ import annotations

from collections.abc import Callable

from loraplex.server.errors import bad_request
from loraplex.server.reasoning_parsers import ReasoningParser
from loraplex.server.refused_fields import AUTO_TOOLS
from loraplex.server.tool_calls import new_call_id, tool_call
from loraplex.server.tool_parsers import ToolCallParser, ToolCallStreamer

REASONING_FIELDS = ("reasoning", "reasoning_content")
PROMPT_TAIL_TOKENS = 32  # enough for "<think>\n\n</think>\n\n", even one token per character


def check_request(ctx, req) -> None:
    """Before any model work: ``"auto"`` needs a tool-call parser (400 otherwise, as vLLM
    without ``--enable-auto-tool-choice``); with one, a parser whose markers are special tokens
    keeps them in the text (as vLLM does for hermes)."""
    if req.kind != "chat" or not req.tools.auto:
        return
    if ctx.tool_parser is None:
        param = req.tools.auto
        raise bad_request(f"`{param}`: {AUTO_TOOLS}.", param=param, code="unsupported_parameter")
    if ctx.tool_parser.keep_special_tokens:
        req.params.skip_special_tokens = False


class ChoiceOutput:
    """One choice's text read by the parsers: ``feed``/``finish`` return deltas (dicts with
    ``content``, ``reasoning`` or one ``tool_calls`` entry); ``message`` reads a whole text."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None, prompt_tail: str = "",
                 max_calls: int | None = None):
        self._with_reasoning = reasoning is not None
        self._max_calls = max_calls  # parallel_tool_calls false: 1 (vLLM drops the later calls, #26233)
        self._split = reasoning.splitter(prompt_tail) if reasoning is not None else None
        self._tools = ToolCallStreamer(tools) if tools is not None else None
        self._content: list[str] = []  # the content part, before tool calls are read out of it

    @property
    def content_text(self) -> str:
        return "".join(self._content)

    @property
    def called(self) -> bool:
        return bool(self._tools and self._tools.has_calls)

    def feed(self, text: str) -> list[dict]:
        parts = self._split.feed(text) if self._split else [("content", text)]
        return self._deltas(parts, final=False)

    def finish(self) -> list[dict]:
        return self._deltas(self._split.finish() if self._split else [], final=True)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" once a call was made; "length" stays "length"."""
        return "tool_calls" if self.called and engine_reason != "length" else engine_reason

    def _deltas(self, parts: list[tuple[str, str]], final: bool) -> list[dict]:
        out: list[dict] = []
        for kind, text in parts:
            if kind == "reasoning":
                _add(out, "reasoning", text)
                continue
            self._content.append(text)
            if self._tools is None:
                _add(out, "content", text)
            else:
                out += self._tool_deltas(self._tools.feed(text))
        if final and self._tools is not None:
            out += self._tool_deltas(self._tools.finish())
        return out

    def _tool_deltas(self, events: list[tuple]) -> list[dict]:
        out: list[dict] = []
        for ev in events:
            if ev[0] != "content" and self._max_calls is not None and ev[1] >= self._max_calls:
                continue
            if ev[0] == "content":
                _add(out, "content", ev[1])
            elif ev[0] == "call":
                out.append({"tool_calls": [{"index": ev[1], "id": new_call_id(), "type": "function",
                                            "function": {"name": ev[2], "arguments": ""}}]})
            else:
                out.append({"tool_calls": [{"index": ev[1], "function": {"arguments": ev[2]}}]})
        return out

    def message(self, text: str, engine_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message of a whole output and its finish reason. Call regions that do
        not all parse leave the content part whole, with no tool calls (vLLM's rule)."""
        deltas = self.feed(text) + self.finish()
        reasoning = "".join(d.get("reasoning", "") for d in deltas) or None
        calls = []
        if self._tools is not None and self._tools.valid and self._tools.calls:
            content = "".join(d.get("content", "") for d in deltas) or None
            calls = [tool_call(name, args) for name, args in self._tools.calls[:self._max_calls]]
        else:
            content = self.content_text
        if reasoning is not None and not content:
            content = None
        msg = {"role": "assistant", "content": content}
        if self._with_reasoning:
            msg.update({field: reasoning for field in REASONING_FIELDS})
        if calls:
            msg["tool_calls"] = calls
            return msg, (engine_reason if engine_reason == "length" else "tool_calls")
        return msg, engine_reason


def _add(out: list[dict], field: str, text: str) -> None:
    """Appends text to the last delta when it is of the same kind, else a new delta."""
    if not text:
        return
    if out and set(out[-1]) == {field}:
        out[-1][field] += text
    else:
        out.append({field: text})


def outputs_for(run) -> Callable[[], ChoiceOutput] | None:
    """A maker of per-choice readers for this request, or None when its text is the answer as
    it is (completions, no parser set, an output constrained from its first token, a tool
    choice)."""
    req, ctx = run.req, run.ctx
    if req.kind != "chat":
        return None
    reasoning = ctx.reasoning_parser
    if req.params.structured_outputs is not None:
        # the constraint holds after the reasoning (a tool choice's calls are read elsewhere),
        # or from the first token: then the text is the answer as it is
        if req.params.reasoning_boundary is None or req.tools.mode is not None:
            return None
        tools = None
    else:
        tools = ctx.tool_parser if req.tools.auto else None
    if tools is None and reasoning is None:
        return None
    tail = prompt_tail(ctx.tokenizer, run.prompt_ids[0]) if reasoning is not None else ""
    max_calls = None if req.tools.parallel else 1
    return lambda: ChoiceOutput(reasoning, tools, tail, max_calls)


def prompt_tail(tokenizer, prompt_ids: list[int]) -> str:
    """The end of a prompt's text, from which the reasoning parser decides where the output
    starts (the splitter and the engine's reasoning boundary read the same)."""
    return tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)


def stream_chunks(shaper, out: ChoiceOutput, choice: int, comp, logprobs) -> list[dict]:
    """The chunks of one engine delta: one per delta of the reader (the engine delta's logprobs
    ride on the first, or on an empty delta of their own), then, when the choice is done, the
    finish reason on a chunk of its own (as OpenAI sends it)."""
    deltas = out.feed(comp.text)
    if comp.finish_reason is not None:
        deltas += out.finish()
    chunks = []
    for k, delta in enumerate(deltas):
        chunk = shaper.chunk(choice, delta.get("content"), None, logprobs if k == 0 else None,
                             tool_calls=delta.get("tool_calls"))
        if "reasoning" in delta:
            chunk["choices"][0]["delta"].update({field: delta["reasoning"] for field in REASONING_FIELDS})
        chunks.append(chunk)
    if not deltas and logprobs is not None:
        chunks.append(shaper.chunk(choice, None, None, logprobs))
    if comp.finish_reason is not None:
        chunks.append(shaper.chunk(choice, None, out.finish_reason(comp.finish_reason)))
    return chunks
