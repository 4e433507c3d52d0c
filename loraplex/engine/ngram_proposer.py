"""Prompt-lookup (n-gram) drafts: guess a sequence's next tokens from its own history.

For n from ``max_n`` down to ``min_n``: find the latest earlier place where the sequence's last
n tokens (prompt + output) occurred, and propose the (up to) ``k`` tokens that followed it. Text
that copies from its context (code edits, quoting answers, JSON rewrites) continues the way the
copied passage did, so such drafts are often right; the model verifies them anyway (see
spec_verify.py). No torch: the scheduler calls this.

The search runs on a numpy array of the history; ``TokenHistory`` keeps one per sequence and
appends the tokens that arrived since the last step, so a step converts only those.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Proposes at most ``k`` draft tokens for a token history (see module doc)."""

    def __init__(self, k: int, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n or k < 1:
            raise ValueError(f"need k >= 1 and 1 <= min_n <= max_n, got k={k} min_n={min_n} max_n={max_n}")
        self.k = k
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """Draft tokens to follow ``token_ids`` (empty when no n-gram recurs); at most
        ``min(k, max_tokens)``."""
        return self.propose_array(np.asarray(token_ids, dtype=np.int64), max_tokens)

    def propose_array(self, tokens: np.ndarray, max_tokens: int | None = None) -> list[int]:
        """``propose`` for a history already in a 1-D int64 array."""
        limit = self.k if max_tokens is None else min(self.k, max_tokens)
        length = len(tokens)
        if limit <= 0 or length <= self.min_n:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # starts i < length - n with tokens[i:i+n] == the last n tokens (the suffix itself,
            # at length - n, is excluded: nothing follows it)
            num_starts = length - n
            match = tokens[:num_starts] == tokens[length - n]
            for j in range(1, n):
                match &= tokens[j : j + num_starts] == tokens[length - n + j]
            hits = np.flatnonzero(match)
            if hits.size:
                follow = int(hits[-1]) + n
                return tokens[follow : follow + limit].tolist()
        return []


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
