"""Structured output: the generated text kept to a JSON schema, any JSON object, a regular
expression, one of a list of strings, or a Lark grammar (vLLM's structured outputs).

A request carries a ``StructuredOutputs`` in its ``SamplingParams``. The engine turns it into an
llguidance matcher per sequence (``loraplex.engine.grammar``); at every step the sampler sets
the logits of tokens the grammar does not allow next to ``-inf`` and advances the matcher with
the sampled token. Once the grammar is complete only EOS is allowed, so the sequence ends with
finish reason ``stop``; ``max_tokens`` can still cut it short (``length``), as in vLLM.

llguidance is imported only when a request asks for structured output.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, fields

from loraplex.sampling_params import InvalidRequestError

# what Rust's regex::escape escapes: the metacharacters of llguidance's regex dialect
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def escape_regex(text: str) -> str:
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)


def _as_lark(grammar: str) -> str:
    """The grammar in llguidance's Lark. GBNF (``root ::= ...``: llama.cpp's, and the EBNF of
    xgrammar that SGLang's ``ebnf`` and vLLM's structured outputs docs write) is converted by
    llguidance, as vLLM's guidance backend converts it; Lark never writes ``::=``."""
    if "::=" not in grammar:
        return grammar
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(grammar)
    except Exception as exc:  # GbnfToLarkError is no ValueError
        raise ValueError(f"not a GBNF grammar: {exc}") from None


@dataclass
class StructuredOutputs:
    """One constraint on the output (exactly one field set), with vLLM's names."""

    json: dict | str | None = None  # a JSON schema (object or its text)
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None  # the whole output matches it
    choice: list[str] | None = None  # the output is exactly one of these
    grammar: str | None = None  # a Lark grammar (llguidance's dialect), or GBNF (``root ::= ...``)
    # JSON without whitespace between tokens (vLLM's option of the same name): small models
    # otherwise spend tokens on newlines and indentation the grammar allows anywhere
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, param: str = "structured_outputs") -> None:
        def bad(message: str) -> None:
            raise InvalidRequestError(message, param=param)

        chosen = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(chosen) != 1:
            bad(f"give exactly one of {', '.join(KINDS)} (got {chosen or 'none'})")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            bad("json must be a JSON schema (an object)")
        if isinstance(self.json, str):
            try:
                if not isinstance(json.loads(self.json), dict):
                    bad("json must be a JSON schema (an object)")
            except ValueError:
                bad("json is not valid JSON")
        if self.json_object not in (True, False):
            bad("json_object must be a boolean")
        if self.disable_any_whitespace not in (True, False):
            bad("disable_any_whitespace must be a boolean")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            bad("regex must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            bad("choice must be a non-empty list of non-empty strings")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            bad("grammar must be a non-empty string")

    def to_grammar(self, param: str = "structured_outputs") -> str:
        """llguidance's grammar for this constraint; a schema that is not a JSON object raises."""
        from llguidance import LLMatcher

        options = {"whitespace_flexible": not self.disable_any_whitespace}
        try:
            if self.json is not None:
                return LLMatcher.grammar_from_json_schema(self.json, defaults=options)
            if self.json_object:
                return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
            if self.regex is not None:
                return LLMatcher.grammar_from_regex(self.regex)
            if self.choice is not None:
                return LLMatcher.grammar_from_regex("(" + "|".join(escape_regex(c) for c in self.choice) + ")")
            return LLMatcher.grammar_from_lark(_as_lark(self.grammar))
        except ValueError as exc:
            raise InvalidRequestError(f"invalid structured output: {exc}", param=param) from None

    def check(self, param: str = "structured_outputs") -> None:
        """Raise ``InvalidRequestError`` naming ``param`` when the schema, regex or grammar is
        not one llguidance can enforce (checked without a tokenizer, before any model work).
        The verdict is kept by the constraint's content (``VERDICTS``): agents send the same
        tool schemas with every request, and compiling one takes about a millisecond of the
        event loop."""
        error = VERDICTS.get(self.cache_key(), self._verdict)
        if error is not None:
            raise InvalidRequestError(error, param=param)

    def cache_key(self) -> str | None:
        """The constraint's content as JSON text; None when it is not JSON (a value not sent
        as JSON). Object keys keep their order: llguidance's grammar, and its first error,
        follow it (an agent sends its schemas the same way each time)."""
        try:
            return json.dumps([getattr(self, f.name) for f in fields(self)], ensure_ascii=False,
                              separators=(",", ":"))
        except (TypeError, ValueError):
            return None

    def _verdict(self) -> str | None:
        """llguidance's verdict: None when the grammar compiles, else the refusal's message."""
        from llguidance import LLMatcher

        try:
            grammar = self.to_grammar()
        except InvalidRequestError as exc:
            return exc.message
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
        return f"invalid structured output: {messages[0].strip()}" if is_error else None


class VerdictCache:
    """The verdicts of ``StructuredOutputs.check`` by key, the most recently used ``size`` of
    them. Safe across threads; two threads asking for a new key at once may both compute it
    (the same verdict)."""

    def __init__(self, size: int):
        self.size = size
        self._verdicts: OrderedDict[str, str | None] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str | None, compute) -> str | None:
        if key is None:
            return compute()
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                return self._verdicts[key]
        verdict = compute()  # outside the lock: a millisecond no other thread need wait for
        with self._lock:
            self._verdicts[key] = verdict
            while len(self._verdicts) > self.size:
                self._verdicts.popitem(last=False)
        return verdict


# check()'s verdicts: an agent's tool schemas, one entry per set of tools it calls with
VERDICTS = VerdictCache(1024)
# the kinds of constraint (vLLM's names): StructuredOutputs' fields, of which one is set
KINDS = tuple(f.name for f in fields(StructuredOutputs) if f.name != "disable_any_whitespace")
