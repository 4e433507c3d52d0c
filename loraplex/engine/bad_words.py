"""vLLM's ``bad_words`` (the sampler's step 4): never generate these token sequences.

Each word becomes token id sequences (``bad_words_token_ids``); a row's next token is forbidden
where it would complete one of them after the tokens the row generated so far. In a step
launched ahead (``schedule_ahead``) a row's last output token may still be being drawn by the
step before, on the device (``penalties.PendingLastTokens``): a word whose prefix ends in that
token is matched on the host up to it, and against the drawn token on the device, so such rows
go ahead too instead of waiting for the token to come back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence as Seq

import numpy as np
import torch

from loraplex.host_arrays import to_tensor

if TYPE_CHECKING:  # pragma: no cover
    from loraplex.engine.penalties import PendingLastTokens
    from loraplex.engine.sequence import Sequence


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's rule: each word as tokenized alone and, where that differs, after a space (how it
    appears inside a text), without special tokens."""
    sequences: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        for ids in (plain, spaced):
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def ban_tokens(logits: torch.Tensor, banned: list[tuple[int, int]]) -> None:
    """``-inf`` at each (row, token) of ``banned``, in place: one write for the batch."""
    if banned:
        index = to_tensor(banned, np.int64, logits.device)  # [B, 2]
        logits[index[:, 0], index[:, 1]] = float("-inf")


def _ends_with(out: list[int], tail: list[int]) -> bool:
    return len(out) >= len(tail) and out[len(out) - len(tail):] == tail


def apply_bad_words(logits: torch.Tensor, seqs: Seq["Sequence"], pending: "PendingLastTokens | None" = None
                    ) -> torch.Tensor:
    """``-inf`` for the token that would complete one of a row's bad token sequences after the
    tokens it generated so far (a one-token word: always), in place. ``pending``: the rows whose
    last output token is still on the device (a step launched ahead)."""
    pending_at = {} if pending is None else {row: i for i, row in enumerate(pending.rows)}
    banned: list[tuple[int, int]] = []  # (row, token)
    if_drawn: list[tuple[int, int, int, int]] = []  # (row, its pending index, the token drawn to ban, token)
    for row, seq in enumerate(seqs):
        sequences = seq.params.bad_words_token_ids
        if not sequences:
            continue
        out, at = seq.output_token_ids, pending_at.get(row)
        for ids in sequences:
            prefix = ids[:-1]
            if not prefix:
                banned.append((row, ids[-1]))
            elif at is None:
                if _ends_with(out, prefix):
                    banned.append((row, ids[-1]))
            elif _ends_with(out, prefix[:-1]):  # the output is out + the token being drawn
                if_drawn.append((row, at, prefix[-1], ids[-1]))
    ban_tokens(logits, banned)
    if if_drawn:
        index = to_tensor(if_drawn, np.int64, logits.device)  # [D, 4]
        drawn = pending.tokens[index[:, 1]] == index[:, 2]
        # added, not written: a (row, token) listed twice (by two words) must not have one
        # entry's "keep" overwrite the other's -inf
        bias = torch.where(drawn, float("-inf"), 0.0).to(logits.dtype)
        logits.index_put_((index[:, 0], index[:, 3]), bias, accumulate=True)
    return logits
