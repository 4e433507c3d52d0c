"""Scheduling step N+1 before step N's tokens are back (``schedule_ahead``, vLLM's async scheduling).

Why: a decode step at large batches is host-bound (H200, 2026-12-04: 5.1 ms of host time per
step at batch 256 against about 2.5 ms of device work), and without this the device idles while
the host schedules, prepares and launches each step. Ahead, the host queues step N+1 right after
step N, so the device runs them back to back while the host reads back and applies step N.

``Scheduler.schedule_ahead(prev)`` builds N+1 from N: the same sequences, in the same order,
each decoding the token N draws for it (in N a decode or a prompt's last chunk), which the
runner takes on the device (``ModelRunner.launch(after=)``). It leaves the state a ``schedule()`` of N+1 would leave
once ``update`` has applied N: each sequence's ``num_computed_tokens`` advanced (``update`` sets
the same) and room for the new token in its blocks. The prefix cache registers only blocks the
known tokens fill (``BlockManager.append``), so the block N's unknown token completes is
registered by the step after, once that token is known.

A sequence that N ends (EOS, a stop token, its length; a stop string one step later) still runs
in N+1: its row is computed and dropped (``update`` skips what is no longer running), and its
blocks go back when it ends, as usual. The KV that row writes lands in a block nobody else holds
yet: a block handed out later is written by later device work, which runs after.

A step goes ahead only from a step whose every sequence samples (decodes, or prompts that end
in it) and that a ``schedule()`` after the update would run again: no chunk short of a prompt's
end, no speculative drafts, blocks free for every new token without preempting, every adapter
still in its device slot (nothing to load, so nothing that could fail to), and no sequence whose
sampling reads its own earlier tokens on the host (penalties, bad words, a grammar, ``min_tokens`` still holding EOS back, a seed, which is
drawn per generated count). Waiting requests are admitted into the step ahead as ``schedule()``
admits them (their prompts are known), except those whose adapter is not in a device slot; if
any is left waiting, the next step is a ``schedule()``, so none waits more than a step longer
than without going ahead. An adapter starving for a slot leaves it to ``schedule()`` too.
Otherwise the engine schedules the next step as before, after the update.
"""

from __future__ import annotations

from loraplex.engine.outputs import SchedulerOutput, ScheduledSeq
from loraplex.engine.sequence import Sequence, SequenceStatus


def samples_without_history(seq: Sequence) -> bool:
    """Whether ``seq``'s next draw reads nothing of its earlier output on the host (the sampler's
    options that do: ``sampler._logit_changes`` and the seeded draw)."""
    p = seq.params
    if seq.grammar is not None or p.bad_words_token_ids:
        return False
    if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
        return False
    if p.min_tokens and len(seq.output_token_ids) < p.min_tokens:
        return False  # the count the step after N sees is one more than the host's now
    return p.seed is None or p.temperature == 0.0


class ScheduleAhead:
    """``Scheduler.schedule_ahead`` (see module doc); a mixin of ``Scheduler``, using its queues,
    block manager, adapter gate, admission (``_admit``, ``_check_starvation``) and ``_output``."""

    def schedule_ahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """Step N+1 from step N (``prev``, launched, not yet updated), or None when it cannot go ahead."""
        if self.drafts is not None or (self.waiting and self._left_waiting):
            return None  # (the step ahead before this one left sequences waiting: schedule() places them)
        entries = prev.scheduled
        if not entries or len(entries) != len(self.running):
            return None  # a running sequence N left out (the token budget) is the scheduler's to place
        if self.waiting:
            self._check_starvation()  # picks S as schedule() would, which then handles it
        if self._starving is not None:
            return None
        running = SequenceStatus.RUNNING
        block_manager = self.block_manager
        need = 0
        adapters = set()
        for entry in entries:
            seq = entry.seq
            if (not entry.needs_sample or entry.draft_token_ids or seq.status is not running
                    or not samples_without_history(seq)):
                return None
            # N+1 computes the position of the token N samples: blocks for one token more
            need += max(0, block_manager.blocks_for(entry.start_pos + entry.num_tokens + 1) - len(seq.block_tables[0]))
            adapters.add(seq.adapter_id)
        if need * block_manager.num_groups > block_manager.num_free_blocks:
            return None  # the scheduler decides whom to preempt, after the update
        adapters.discard(None)
        if adapters and self.adapter_gate is not None and not all(map(self.adapter_gate.is_placed, adapters)):
            return None  # an adapter left its slot: placing it again may fail, which a normal step handles
        self.stats.num_steps += 1
        self._first_admitted = []
        scheduled: dict[int, ScheduledSeq] = {}
        for entry in entries:
            seq = entry.seq
            seq.num_computed_tokens = entry.start_pos + entry.num_tokens  # as update() will set it
            block_manager.append(seq, 1)
            tables = seq.block_tables
            scheduled[seq.seq_id] = ScheduledSeq(seq, seq.num_computed_tokens, 1, tables[0], True, seq.adapter_id,
                                                 [], tables)
        if self.waiting:  # their prompts are known: admitted here as schedule() would, adapters in slots only
            self._admit(scheduled, self.config.max_num_batched_tokens - len(scheduled), placed_only=True)
        self._left_waiting = bool(self.waiting)
        return self._output(scheduled)
