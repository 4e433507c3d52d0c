"""The scheduler's half of a step's end: ``Scheduler.update`` applies what the model sampled
(computed tokens advance, sampled tokens are appended, stop checks end sequences). A mixin of
``Scheduler`` (scheduler.py), kept apart so each file holds one job. Pure Python, no torch.
"""

from __future__ import annotations

import time

from loraplex.engine.outputs import ModelRunnerOutput, SchedulerOutput
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.engine.spec_verify import num_accepted


class StepResults:
    """``Scheduler.update`` and its helpers; reads the scheduler's ``stats``, ``block_manager``,
    ``eos_token_ids``, ``reported_eos_token_ids``, ``max_model_len``, ``_seqs`` and ``_release``."""

    def update(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[Sequence]:
        """Apply a step's results: advance computed tokens, append sampled tokens, stop checks.
        Returns the sequences that got a new token (finished ones included)."""
        changed: list[Sequence] = []
        now = time.monotonic()
        for seq_id, entries in runner_out.prompt_logprobs.items():
            seq = self._seqs.get(seq_id)
            if seq is not None:
                seq.prompt_logprobs.extend(entries)
        stats, release_out_of_window = self.stats, self.block_manager.release_out_of_window
        sampled_tokens, running_status = runner_out.sampled, SequenceStatus.RUNNING
        for entry in sched_out.scheduled:
            seq = entry.seq
            if seq.status is not running_status:
                continue  # aborted while the step ran
            if entry.draft_token_ids:
                self._apply_verified(seq, entry.draft_token_ids, runner_out.verified[seq.seq_id], now)
                changed.append(seq)
                continue
            num_tokens = entry.num_tokens
            seq.num_computed_tokens = entry.start_pos + num_tokens
            # blocks the next chunk will not read go back now, so KV usage says what is held
            release_out_of_window(seq)
            out = seq.output_token_ids
            if not entry.needs_sample:
                stats.num_prompt_tokens_computed += num_tokens
                continue
            if num_tokens != 1 or not out:  # not a decode
                stats.num_prompt_tokens_computed += num_tokens
            sampled = sampled_tokens[seq.seq_id]
            # _append_token, spelled out (per sequence per step)
            token = sampled.token_id
            out.append(token)
            if seq.params.logprobs is not None:
                seq.output_logprobs.append(
                    {"token_id": token, "logprob": sampled.logprob, "top_logprobs": sampled.top_logprobs})
            if seq.first_token_time is None:
                seq.first_token_time = now
            stats.num_generated_tokens += 1
            status, reason = self._check_stop(seq, token)
            if status is not None:
                self._release(seq, status, reason)
            changed.append(seq)
        return changed

    def _apply_verified(self, seq: Sequence, draft: list[int], sampled: list, now: float) -> None:
        """A speculative step's result: append the accepted drafts and the token after them,
        one at a time through the stop checks (tokens after a stop are dropped), then give back
        the KV of what was rejected (spec_verify.py)."""
        accepted = num_accepted(draft, [t.token_id for t in sampled])
        self.stats.num_spec_drafts += 1
        self.stats.num_spec_draft_tokens += len(draft)
        self.stats.num_spec_accepted_tokens += accepted
        status, reason = None, None
        for token in sampled[: accepted + 1]:
            self._append_token(seq, token, now)
            status, reason = self._check_stop(seq, token.token_id)
            if status is not None:
                break
        # every appended token but the last is computed (the step's last token and the
        # accepted drafts); KV written for rejected drafts is not, and their blocks go back
        seq.num_computed_tokens = seq.num_tokens - 1
        self.block_manager.drop_uncomputed_blocks(seq)
        self.block_manager.release_out_of_window(seq)
        if status is not None:
            self._release(seq, status, reason)

    def _append_token(self, seq: Sequence, sampled, now: float) -> None:
        seq.output_token_ids.append(sampled.token_id)
        if seq.params.logprobs is not None:
            seq.output_logprobs.append(
                {"token_id": sampled.token_id, "logprob": sampled.logprob, "top_logprobs": sampled.top_logprobs}
            )
        if seq.first_token_time is None:
            seq.first_token_time = now
        self.stats.num_generated_tokens += 1

    def _check_stop(self, seq: Sequence, token: int) -> tuple[SequenceStatus | None, int | None]:
        params = seq.params
        num_output_tokens = len(seq.output_token_ids)  # once: every sampled token is checked
        if num_output_tokens >= params.min_tokens:
            # EOS first, as vLLM's check_stop: the tokenizer's EOS reports no stop_reason even
            # when listed in stop_token_ids, the generation config's others report their id (with
            # ignore_eos an EOS is a stop token only where the request lists it)
            if not params.ignore_eos and token in self.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED, (token if token in self.reported_eos_token_ids else None)
            if token in params.stop_token_ids:
                return SequenceStatus.FINISHED_STOPPED, token
        if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH, None
        if self.max_model_len is not None and len(seq.prompt_token_ids) + num_output_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH, None
        return None, None
