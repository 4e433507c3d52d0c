"""Prompt-lookup (n-gram) drafts: guess a sequence's next tokens from its own history.

For n from ``max_n`` down to ``min_n``: find the latest earlier place where the sequence's last
n tokens (prompt + output) occurred, and propose the (up to) ``k`` tokens that followed it. Text
that copies from its context (code edits, quoting answers, JSON rewrites) continues the way the
copied passage did, so such drafts are often right; the model verifies them anyway (see
spec_verify.py). No torch: the scheduler calls this.

The search runs on a numpy array of the history; ``token_history.TokenHistory`` keeps one per
sequence and appends the tokens that arrived since the last step, so a step converts only those.
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
