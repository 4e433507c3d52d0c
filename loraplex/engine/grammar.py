"""llguidance matchers for the engine's tokenizer (see ``loraplex.structured_output``).

The llguidance tokenizer is built from the model's tokenizer on first use (0.44 s for
SmolLM2's 49k vocabulary) and kept: ``loraplex serve`` builds it in a background thread at
start (``warm``), so the first structured request does not hold up the engine thread. Every
sequence gets its own matcher (the async engine makes it in a worker thread), advanced by the
sampler with each token it samples.
"""

from __future__ import annotations

import threading

import numpy as np

from loraplex.sampling_params import InvalidRequestError
from loraplex.structured_output import StructuredOutputs

class GrammarFactory:
    """Makes llguidance matchers for one tokenizer and vocabulary size."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._lltokenizer = None
        self._lock = threading.Lock()  # warm() in a thread and the first request may meet
        self._executor = None  # llguidance's thread pool for the per-step masks

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

    def matcher(self, spec: StructuredOutputs):
        """A fresh matcher at the start of the output; a grammar llguidance refuses raises
        ``InvalidRequestError`` (param ``structured_outputs``)."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self._llguidance_tokenizer(), spec.to_grammar(), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(
                f"invalid structured output: {matcher.get_error().strip()}", param="structured_outputs"
            )
        return matcher

    def allowed_tokens(self, matchers: list) -> np.ndarray:  # [len(matchers), vocab_size] bool
        """The tokens each matcher allows next, computed for all of them in parallel on
        llguidance's threads (one mask costs tens of microseconds: 256 structured streams would
        add milliseconds per step one by one). Every matcher here was made by this factory, so
        its mask has exactly ``ceil(vocab_size / 32)`` 32-bit words, the buffer's row size."""
        from llguidance import LLExecutor

        if self._executor is None:
            self._executor = LLExecutor()
        words = (self.vocab_size + 31) // 32
        masks = np.zeros((len(matchers), words), dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], masks.ctypes.data, words * 4, len(matchers)
        )
        return np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size].astype(bool)
