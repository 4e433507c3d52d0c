"""A step queued on the device and not yet read back (``PendingRun``), and how a step launched
ahead of it takes its input tokens from it on the device (``schedule_ahead``)."""

from __future__ import annotations

import numpy as np
import torch

from loraplex.host_arrays import to_device
from loraplex.engine.outputs import ModelRunnerOutput, ScheduledSeq
from loraplex.engine.penalties import PendingLastTokens
from loraplex.engine.sampler import PendingTokens, Sampler
from loraplex.engine.spec_verify import PositionView
from loraplex.sampling_params import SamplingParams


class DeferredDraw:
    """A step's draw queued only once the step before it is applied: a step launched ahead
    (``schedule_ahead``) whose rows include a grammar's still being drawn by the step before,
    which the grammar's matcher must take on the host before it allows the next token. The
    step's logits are computed at launch, so the device runs its forward meanwhile; the draw is
    queued when a later step needs its tokens (``token_ids``: the step after it launched ahead)
    or when it is read (``result``), both after the engine applied the step before. By then the
    host has every row's last token, so the draw reads none of them on the device. A row whose
    sequence has ended since (its row is dropped, as in any step ahead) is drawn greedily with
    no option: its grammar is not advanced, and nothing is kept for it (the runner may have
    released the sequence already: a repetition penalty would keep its prompt again)."""

    __slots__ = ("_launch", "_tokens")

    def __init__(self, sampler: Sampler, logits: torch.Tensor, seqs: list, eos_token_ids):
        # logits: [num_sampled, vocab] fp32
        def launch() -> PendingTokens:
            rows = [_ended_row(seq) if seq.is_finished else seq for seq in seqs]
            return sampler.launch(logits, rows, eos_token_ids)

        self._launch = launch
        self._tokens: PendingTokens | None = None

    def launched(self) -> PendingTokens:
        if self._tokens is None:
            self._tokens, self._launch = self._launch(), None
        return self._tokens

    @property
    def token_ids(self) -> torch.Tensor:  # [num_sampled] int64, on the device
        return self.launched().token_ids

    def result(self):
        return self.launched().result()


def _ended_row(seq) -> PositionView:
    """A dropped row's stand-in in a deferred draw: greedy, with no option, no grammar."""
    return PositionView(seq.prompt_token_ids, seq.output_token_ids, SamplingParams(temperature=0.0), seq.index,
                        seq.seq_id)


class PendingRun:
    """A step queued by ``ModelRunner.launch``; ``result()`` waits for its sampled tokens and
    returns the step's ``ModelRunnerOutput`` (once)."""

    def __init__(self, tokens: PendingTokens | DeferredDraw | None, seqs: list, verify_spans: list[tuple] = (),
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
