"""A sequence's tokens as a numpy array grown as they arrive (``TokenHistory``), for the host
work that reads a sequence's whole history every step: the n-gram proposer's search
(``spec_drafts``) and the penalties' output tokens (``penalties``). Converting a Python list of
1,000 tokens costs about 25 us on the CI VM; appending the one new token costs next to nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from loraplex.engine.sequence import Sequence


class TokenHistory:
    """A sequence's tokens (prompt + output) in a numpy array with room to grow.

    A live sequence's tokens are only ever appended (a stop string trims them only as the
    sequence ends), so ``view`` converts just the tokens that arrived since its last call. A
    history that got shorter, or whose last known token changed, is rebuilt whole."""

    __slots__ = ("_buf", "_len")

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.int64)
        self._len = 0

    def view(self, seq) -> np.ndarray:
        """``seq.all_token_ids`` as an int64 array (a view of the buffer: read, do not keep)."""
        n, known = seq.num_tokens, self._len
        if n < known or (known and self._buf[known - 1] != seq.token_at(known - 1)):
            known = 0  # not a continuation of what is held
        if n > known:
            if n > len(self._buf):  # doubling: appends cost O(1) amortised
                grown = np.empty(max(n, 2 * len(self._buf), 64), dtype=np.int64)
                grown[:known] = self._buf[:known]
                self._buf = grown
            self._buf[known:n] = seq.token_slice(known, n)
        self._len = n
        return self._buf[:n]


def history_of(seq: "Sequence") -> TokenHistory:
    """``seq``'s history, made on first use and kept on the sequence."""
    history = seq.token_history
    if history is None:
        history = seq.token_history = TokenHistory()
    return history
