"""Repetition, frequency and presence penalties for a whole batch at once (the sampler's step 3).

Why batched: one row at a time cost a host-to-device copy of the row's tokens and a few
launches per penalized row, per step (at 256 rows, hundreds of synchronous copies a step on a
GPU). Here the penalized rows' output tokens go up as one flat array (page-locked, without
waiting) and the counts come from one scatter.

The repetition penalty also reads each row's prompt. Turning a 1,000-token prompt from a Python
list into an array costs about 25 us on the CI VM, so 6-8 ms a step at 256 such rows; with
``PromptTokens`` each prompt goes up once and stays on the device until its sequence is released.
The output tokens, which grow, are read from each sequence's ``TokenHistory`` (a numpy array
that converts only the tokens added since the last step), not converted whole each step.

Rows of a step launched ahead (``schedule_ahead``) may not have their last output token on the
host yet: the step before is still drawing it. ``pending`` gives those rows and the tokens, on
the device, and they count as output like the rest.
"""

from __future__ import annotations

from typing import Sequence as Seq

import numpy as np
import torch

from loraplex.host_arrays import to_device
from loraplex.engine.sequence import Sequence
from loraplex.engine.token_history import history_of


class PendingLastTokens:
    """Sampled rows whose last output token the host does not have yet (a step launched ahead):
    ``rows`` (indices into the step's sampled rows) and ``tokens`` ([len(rows)] int64 on the
    device, the step before's draw for each)."""

    __slots__ = ("rows", "tokens", "_row_set")

    def __init__(self, rows: list[int], tokens: torch.Tensor):
        self.rows = rows
        self.tokens = tokens
        self._row_set: frozenset[int] | None = None  # built when first asked (most steps never are)

    def num_generated(self, row: int, seq: "Sequence") -> int:
        """Tokens ``seq`` has generated, the one still being drawn included."""
        if self._row_set is None:
            self._row_set = frozenset(self.rows)
        return len(seq.output_token_ids) + (row in self._row_set)


def _flat_tokens(token_lists: "list[list[int] | np.ndarray]", vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Every list's ids one after another ([total] int64; ids outside the vocabulary as
    ``vocab``, a spare column dropped after the scatter) and each list's length ([n] int64).
    One concatenation: padding to the longest list filled twice its size (256 rows of 1,000
    output tokens: 0.53 against 0.29 ms on the CI VM)."""
    arrays = [t if isinstance(t, np.ndarray) else np.asarray(t, dtype=np.int64) for t in token_lists]
    flat = np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)
    if flat.size and (flat.min() < 0 or flat.max() > vocab):
        flat = np.where((flat < 0) | (flat > vocab), vocab, flat)
    return flat, np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))


def _row_starts(lengths: np.ndarray, width: int, device: torch.device) -> torch.Tensor:
    """[lengths.sum()] int64: ``r * width`` for each of row r's entries, so that row r's token t
    lands at ``r * width + t`` of a flattened [rows, width] tensor (one scatter for all rows)."""
    return torch.repeat_interleave(torch.arange(0, len(lengths) * width, width, device=device),
                                   to_device(lengths, device), output_size=int(lengths.sum()))


def _output_tokens(seq) -> "list[int] | np.ndarray":
    """A row's output token ids: of a ``Sequence``, from its ``TokenHistory`` (which converts
    only the tokens added since the last step); else (a speculative step's ``PositionView``) its
    list."""
    if isinstance(seq, Sequence):
        return history_of(seq).view(seq)[len(seq.prompt_token_ids):]
    return seq.output_token_ids


class PromptTokens:
    """Each sequence's prompt token ids on the device (ids outside the vocabulary as ``vocab``),
    uploaded the first time a step penalizes it and kept until ``forget`` (the runner's
    ``release``: finished or preempted). Keyed by ``seq_id``: a speculative step's position
    views of one sequence share its entry."""

    def __init__(self):
        self._ids: dict[int, torch.Tensor] = {}  # seq_id -> [prompt_len] int64

    def __len__(self) -> int:
        return len(self._ids)

    def forget(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self._ids.pop(seq_id, None)

    def seen(self, seqs: list["Sequence | None"], vocab: int, device: torch.device) -> torch.Tensor:
        """[len(seqs), vocab + 1] bool: the tokens of each one's prompt (column ``vocab`` is
        spare; a row of None has none)."""
        parts, empty = [], torch.empty(0, dtype=torch.int64, device=device)
        for seq in seqs:
            if seq is None:
                parts.append(empty)
                continue
            ids = self._ids.get(seq.seq_id)
            if ids is None:
                prompt = np.array(seq.prompt_token_ids, dtype=np.int64)
                prompt[(prompt < 0) | (prompt > vocab)] = vocab
                ids = self._ids[seq.seq_id] = to_device(prompt, device)
            parts.append(ids)
        lengths = np.array([part.shape[0] for part in parts], dtype=np.int64)
        width = vocab + 1
        seen = torch.zeros(len(seqs) * width, dtype=torch.bool, device=device)
        seen[_row_starts(lengths, width, device) + torch.cat(parts)] = True
        return seen.view(len(seqs), width)


def apply_penalties(logits: torch.Tensor, seqs: Seq["Sequence"], prompts: PromptTokens,
                    pending: PendingLastTokens | None = None) -> torch.Tensor:
    """Repetition (prompt + output), frequency and presence (output only) penalties, in place.
    ``logits``: [rows, vocab] fp32; ``seqs``: one per row; ``prompts``: where the repetition
    penalty finds the prompts on the device (a fresh one uploads them for this call)."""
    rows, reps, freqs, press = [], [], [], []
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            rows.append(row)
            reps.append(p.repetition_penalty)
            freqs.append(p.frequency_penalty)
            press.append(p.presence_penalty)
    if not rows:
        return logits
    vocab, device, dtype = logits.shape[1], logits.device, logits.dtype
    flat, lengths = _flat_tokens([_output_tokens(seqs[r]) for r in rows], vocab)
    index = _row_starts(lengths, vocab + 1, device) + to_device(flat, device)  # [total output tokens]
    counts = torch.zeros(len(rows) * (vocab + 1), dtype=dtype, device=device)
    counts.index_add_(0, index, torch.ones(flat.shape[0], dtype=dtype, device=device))
    counts = counts.view(len(rows), vocab + 1)
    if pending is not None:
        at = {row: i for i, row in enumerate(rows)}
        hits = [(at[row], j) for j, row in enumerate(pending.rows) if row in at]
        if hits:
            index = to_device(np.array(hits, dtype=np.int64), device)  # [H, 2]: (penalized row, pending row)
            tokens = pending.tokens[index[:, 1]]
            counts.index_put_((index[:, 0], torch.where(tokens < vocab, tokens, vocab)),
                              torch.ones(len(hits), dtype=dtype, device=device), accumulate=True)
    counts = counts[:, :vocab]  # [R, vocab]
    index = to_device(np.array(rows, dtype=np.int64), device)
    penalized = logits[index]  # [R, vocab]
    if any(r != 1.0 for r in reps):
        # only rows with a repetition penalty read their prompt
        with_prompt = [seqs[r] if rep != 1.0 else None for r, rep in zip(rows, reps)]
        seen = prompts.seen(with_prompt, vocab, device)[:, :vocab] | (counts > 0)
        rep = to_device(np.array(reps, dtype=np.float32), device).to(dtype).unsqueeze(1)
        # a row without it divides and multiplies by 1.0: its logits are left as they are
        penalized = torch.where(seen, torch.where(penalized > 0, penalized / rep, penalized * rep), penalized)
    if any(freqs) or any(press):
        freq = to_device(np.array(freqs, dtype=np.float32), device).to(dtype).unsqueeze(1)
        pres = to_device(np.array(press, dtype=np.float32), device).to(dtype).unsqueeze(1)
        penalized -= freq * counts + pres * (counts > 0).to(dtype)
    logits[index] = penalized
    return logits
