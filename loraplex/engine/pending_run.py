"""A step queued on the device and not yet read back (``PendingRun``), and how a step launched
ahead of it takes its input tokens from it on the device (``schedule_ahead``)."""

from __future__ import annotations

import numpy as np
import torch

from loraplex.engine.host_arrays import to_device
from loraplex.engine.outputs import ModelRunnerOutput, ScheduledSeq
from loraplex.engine.penalties import PendingLastTokens
from loraplex.engine.sampler import PendingTokens


class PendingRun:
    """A step queued by ``ModelRunner.launch``; ``result()`` waits for its sampled tokens and
    returns the step's ``ModelRunnerOutput`` (once)."""

    def __init__(self, tokens: PendingTokens | None, seqs: list, verify_spans: list[tuple] = (),
                 prompt_logprobs: dict | None = None):
        self.tokens = tokens  # None: the step samples nothing
        self.seqs = seqs  # one per sampled row (a speculative sequence: one PositionView per verified row)
        self.verify_spans = verify_spans  # (seq_id, first row, rows) per speculative sequence
        self.prompt_logprobs = prompt_logprobs or {}

    def result(self) -> ModelRunnerOutput:
        if self.tokens is None:
            return ModelRunnerOutput(sampled={}, prompt_logprobs=self.prompt_logprobs)
        tokens, seqs, spans = self.tokens.result(), self.seqs, self.verify_spans
        if not spans:
            sampled = {seq.seq_id: tok for seq, tok in zip(seqs, tokens)}
            return ModelRunnerOutput(sampled=sampled, prompt_logprobs=self.prompt_logprobs)
        verified = {seq_id: tokens[first : first + count] for seq_id, first, count in spans}
        in_span = {row for _, first, count in spans for row in range(first, first + count)}
        sampled = {seq.seq_id: tok for row, (seq, tok) in enumerate(zip(seqs, tokens)) if row not in in_span}
        return ModelRunnerOutput(sampled=sampled, verified=verified, prompt_logprobs=self.prompt_logprobs)


def last_tokens_ahead(items: list[ScheduledSeq], sampled_rows: list[int], after: PendingRun) -> PendingLastTokens:
    """The tokens ``after`` is still sampling for ``items`` (this step's decode entries whose
    last token the host lacks), for the sampler at ``sampled_rows`` (each item's index among the
    step's sampled rows); ``put_pending`` writes the same tokens into the step's input ids."""
    return PendingLastTokens(sampled_rows, tokens_after(items, after))


def put_pending(input_ids: torch.Tensor, rows: list[int], tokens: torch.Tensor) -> None:
    """Write into ``input_ids`` ([T] int64 on the device), at each of ``rows``, the matching one of
    ``tokens`` ([len(rows)] int64 on the device: ``tokens_after`` the step before)."""
    if not rows:
        return
    if len(rows) == input_ids.shape[0]:  # every row (rows 0..T-1): a step of decodes alone
        input_ids.copy_(tokens)
        return
    input_ids.index_copy_(0, to_device(np.array(rows, dtype=np.int64), input_ids.device), tokens)


def pending_items(scheduled: list[ScheduledSeq], rows: list[int]) -> list[ScheduledSeq]:
    """The entries of a one-token step's pending ``rows`` (``DecodeInputs.pending_rows``)."""
    return scheduled if len(rows) == len(scheduled) else [scheduled[row] for row in rows]


def tokens_after(scheduled: list[ScheduledSeq], after: PendingRun) -> torch.Tensor:  # [num_seqs] int64
    """The token ``after`` samples for each sequence of ``scheduled``, in that order, on the
    device (nothing is read back: the step before may still be running)."""
    tokens = after.tokens.token_ids  # [num_sampled] int64, in after.seqs order
    if len(after.seqs) == len(scheduled) and all(seq is item.seq for seq, item in zip(after.seqs, scheduled)):
        return tokens  # the same sequences in the same order: what schedule_ahead makes
    rows = {seq.seq_id: row for row, seq in enumerate(after.seqs)}
    order = [rows[item.seq.seq_id] for item in scheduled]
    return tokens[to_device(np.array(order, dtype=np.int64), tokens.device)]
