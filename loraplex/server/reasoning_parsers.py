"""Reasoning parsers (``--reasoning-parser NAME``, vLLM's names): the text a model writes inside
``<think>...</think>`` goes to the chat message's reasoning field, the rest is ``content``
(and is what the tool-call parser reads, when one is set). Chat only: completions return the
raw text, as vLLM's do.

- ``deepseek_r1``: DeepSeek-R1's template ends the prompt with ``<think>``, so the output starts
  inside the reasoning; everything before ``</think>`` is reasoning (a ``<think>`` the model
  writes itself at the start is dropped); no ``</think>`` at all: all reasoning (cut short).
- ``qwen3``: Qwen3 writes ``<think>`` itself; an output that starts with it is reasoning up to
  ``</think>`` (all of it when cut short), and an output without it is all content (Qwen3 with
  thinking disabled writes no tags; the template puts an empty think block in the prompt).
  Templates that open ``<think>`` in the prompt (Qwen3-*-Thinking-2507) read as deepseek_r1.

For both, the prompt decides first, as vLLM's serving layer does with the prompt's tokens: a
prompt that ends with ``</think>`` (thinking switched off by the template) makes the output all
content, one that ends with ``<think>`` makes it start inside the reasoning.

Streaming holds back only what could be the start of a tag; the pieces join into exactly the
reasoning and content of the same output read whole.
"""

from __future__ import annotations

from loraplex.server.tool_parsers import partial_marker_len

THINK, END_THINK = "<think>", "</think>"
_WS = " \t\n\r"


class ReasoningSplitter:
    """One output: ``feed(text)`` and ``finish()`` return ``("reasoning", s)`` and
    ``("content", s)`` pieces, in order."""

    def __init__(self, state: str):
        self.state = state  # "detect" | "lead" | "reasoning" | "content"
        self.buf = ""
        # the output's leading whitespace, set aside while a <think> may still come: kept in
        # buf, every piece would scan all of it again (a model writing newlines for thousands
        # of tokens took minutes)
        self._lead: list[str] = []

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        return self._run(False)

    def finish(self) -> list[tuple[str, str]]:
        return self._run(True)

    def _run(self, final: bool) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        while True:
            if self.state in ("detect", "lead"):  # a <think> at the start?
                rest = self.buf.lstrip(_WS)
                if rest.startswith(THINK):
                    self.buf, self.state, self._lead = rest[len(THINK):], "reasoning", []
                    continue
                if not final and THINK.startswith(rest):  # nothing yet, or a part of the tag
                    if not rest:
                        self._lead.append(self.buf)
                        self.buf = ""
                    return out
                self.buf = "".join(self._lead) + self.buf
                self._lead = []
                self.state = "content" if self.state == "detect" else "reasoning"
                continue
            if self.state == "reasoning":
                i = self.buf.find(END_THINK)
                if i >= 0:
                    if i:
                        out.append(("reasoning", self.buf[:i]))
                    self.buf, self.state = self.buf[i + len(END_THINK):], "content"
                    continue
                keep = 0 if final else partial_marker_len(self.buf, END_THINK)
                if len(self.buf) > keep:
                    out.append(("reasoning", self.buf[:len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep:]
                return out
            if self.buf:
                out.append(("content", self.buf))
            self.buf = ""
            return out


class ReasoningParser:
    """A model's reasoning syntax: ``splitter(prompt_tail)`` reads one output, given the end of
    its prompt's text."""

    name = ""
    unopened = "lead"  # where an output starts when the prompt says nothing

    def splitter(self, prompt_tail: str = "") -> ReasoningSplitter:
        tail = prompt_tail.rstrip(_WS)
        if tail.endswith(END_THINK):
            return ReasoningSplitter("content")
        if tail.endswith(THINK):
            return ReasoningSplitter("lead")
        return ReasoningSplitter(self.unopened)


class DeepSeekR1Parser(ReasoningParser):
    """Everything up to ``</think>`` is reasoning."""

    name = "deepseek_r1"


class Qwen3Parser(ReasoningParser):
    """Reasoning only inside a ``<think>`` the output starts with."""

    name = "qwen3"
    unopened = "detect"


REASONING_PARSERS: dict[str, ReasoningParser] = {"deepseek_r1": DeepSeekR1Parser(), "qwen3": Qwen3Parser()}


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser of that name (None for None); an unknown name is a ValueError listing them."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown --reasoning-parser {name!r}; known: {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]
