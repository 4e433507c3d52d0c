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

A request kept to a constraint gets the same decision as token ids (``boundary``): the engine
starts the grammar after ``</think>`` where the splitter starts the content
(reasoned_constraints.py). The tags are matched there as the tokenizer encodes them (one token
each in Qwen3's and DeepSeek-R1's vocabularies); a model spelling a tag in other tokens, or
writing whitespace before an opening ``<think>``, is read by the splitter but not by the engine.
"""

from __future__ import annotations

from collections.abc import Callable

from loraplex.reasoning_boundary import ReasoningBoundary
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
    its prompt's text; ``boundary`` tells the engine the same for structured output."""

    name = ""
    unopened = "lead"  # where an output starts when the prompt says nothing

    def start_state(self, prompt_tail: str = "") -> str:
        """Where an output after this prompt starts: "content", "lead" (reasoning, maybe after
        a ``<think>`` of its own) or "detect" (reasoning only if it opens with ``<think>``)."""
        tail = prompt_tail.rstrip(_WS)
        if tail.endswith(END_THINK):
            return "content"
        if tail.endswith(THINK):
            return "lead"
        return self.unopened

    def splitter(self, prompt_tail: str = "") -> ReasoningSplitter:
        return ReasoningSplitter(self.start_state(prompt_tail))

    def boundary(self, prompt_tail: str, encode: Callable[[str], list[int]]) -> ReasoningBoundary:
        """Where structured output starts in an output after this prompt, for the engine: the
        token ids of the tags (``encode``: the tokenizer, without special tokens added) and the
        splitter's own start, so the grammar begins where the splitter's content does."""
        starts_in = {"content": "content", "lead": "reasoning", "detect": "either"}[self.start_state(prompt_tail)]
        return ReasoningBoundary(end_token_ids=tuple(encode(END_THINK)), start_token_ids=tuple(encode(THINK)),
                                 starts_in=starts_in)


    def check_tokenizer(self, tokenizer) -> None:
        """Refuse (ValueError) a tokenizer without ``<think>`` and ``</think>`` as single tokens,
        as vLLM's thinking parsers refuse to start (BaseThinkingReasoningParser: "could not
        locate think start/end tokens in the tokenizer"): structured output after reasoning
        finds the boundary by these tokens (``boundary``), and a tag spelt in several tokens is
        never seen there. Each must be a vocabulary entry that encodes as itself alone."""
        vocab = tokenizer.get_vocab()
        for tag in (THINK, END_THINK):
            ids = list(tokenizer(tag, add_special_tokens=False)["input_ids"])
            if tag not in vocab or ids != [vocab[tag]]:
                raise ValueError(
                    f"--reasoning-parser {self.name}: {tag} is not one token of the model's tokenizer "
                    f"(it encodes as {len(ids)} tokens); this parser needs {THINK} and {END_THINK} as single "
                    "tokens, as vLLM's does, which refuses to start the same way: serve a thinking model "
                    "(Qwen3, DeepSeek-R1) or leave --reasoning-parser out")


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
