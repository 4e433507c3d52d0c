"""llguidance matchers for the engine's tokenizer (see ``loraplex.structured_output``).

The llguidance tokenizer is built from the model's tokenizer on first use (0.44 s for
SmolLM2's 49k vocabulary) and kept: ``loraplex serve`` builds it in a background thread at
start (``warm``), so the first structured request does not hold up the engine thread; the grammar of a constraint is compiled once and cached, and every
sequence gets its own matcher, advanced by the sampler with each token it samples.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from loraplex.sampling_params import InvalidRequestError
from loraplex.structured_output import StructuredOutputs

GRAMMAR_CACHE_SIZE = 256


class GrammarFactory:
    """Makes llguidance matchers for one tokenizer and vocabulary size."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._lltokenizer = None
        self._lock = threading.Lock()  # warm() in a thread and the first request may meet
        self._grammars: OrderedDict[str, str] = OrderedDict()

    def warm(self) -> None:
        """Build the llguidance tokenizer now (a thread at server start); errors wait for a
        request that needs it."""
        try:
            self._llguidance_tokenizer()
        except Exception:  # noqa: BLE001 - reported to the request that asks for structured output
            pass

    def _llguidance_tokenizer(self):
        with self._lock:
            if self._lltokenizer is None:
                import llguidance.hf

                try:
                    self._lltokenizer = llguidance.hf.from_tokenizer(
                        self._tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_token_ids or None
                    )
                except ValueError as exc:  # not a fast (Rust) tokenizer
                    raise InvalidRequestError(
                        f"structured output needs a fast tokenizer: {exc}", param="structured_outputs"
                    ) from None
            return self._lltokenizer

    def _grammar(self, spec: StructuredOutputs) -> str:
        key = spec.cache_key()
        grammar = self._grammars.get(key)
        if grammar is None:
            grammar = spec.to_grammar()
            self._grammars[key] = grammar
            if len(self._grammars) > GRAMMAR_CACHE_SIZE:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(key)
        return grammar

    def matcher(self, spec: StructuredOutputs):
        """A fresh matcher at the start of the output; a grammar llguidance refuses raises
        ``InvalidRequestError`` (param ``structured_outputs``)."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self._llguidance_tokenizer(), self._grammar(spec), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(
                f"invalid structured output: {matcher.get_error().strip()}", param="structured_outputs"
            )
        return matcher
