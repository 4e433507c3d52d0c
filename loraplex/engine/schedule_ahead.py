"""Scheduling step N+1 before step N's tokens are back (``schedule_ahead``, vLLM's async scheduling).

Why: a decode step at large batches is host-bound (H200, 2026-12-04: 5.1 ms of host time per
step at batch 256 against about 2.5 ms of device work), and without this the device idles while
the host schedules, prepares and launches each step. Ahead, the host queues step N+1 right after
step N, so the device runs them back to back while the host reads back and applies step N.

``Scheduler.schedule_ahead(prev)`` builds N+1 from N as ``schedule()`` would after N's update:
decodes first, then the prompts' next chunks, each in running order, within the same token
budget. A decode's token is the one N draws for it (in N a decode or a prompt's last chunk),
which the runner takes on the device (``ModelRunner.launch(after=)``); a chunk is of known
prompt tokens. It leaves the state a ``schedule()`` of N+1 would leave once ``update`` has
applied N: each sequence's ``num_computed_tokens`` advanced (``update`` sets the same) and room
for its new tokens in its blocks. The prefix cache registers only blocks the known tokens fill
(``BlockManager.append``), so the block N's unknown token completes is registered by the step
after, once that token is known.

A sequence that N ends (EOS, a stop token, its length; a stop string one step later) still runs
in N+1: its row is computed and dropped (``update`` skips what is no longer running), and its
blocks go back when it ends, as usual. The KV that row writes lands in a block nobody else holds
yet: a block handed out later is written by later device work, which runs after. (Its token of
the budget may cut a chunk in N+1 a token shorter than ``schedule()`` would: the same outputs.)

A sequence that ended after N was built (N computes its row and drops it) is left out of N+1,
as ``schedule()`` leaves it out. A step goes ahead from a step N that ran every running sequence
and that a ``schedule()`` after the update would run again: no speculative drafts, blocks free
for every new token without preempting, every adapter still in its device slot (nothing to load,
so nothing that could fail to), and no chunk that reports prompt logprobs (which positions it
reports depends on what N's update appends). Waiting requests are admitted into the step ahead as ``schedule()`` admits them (their
prompts are known), except those whose adapter is not in a device slot. A request the token
budget holds back would be held back by ``schedule()`` too; if anything else held one back
(seats, blocks or adapter slots that sequences ending in N may free, an adapter to place), the
next step is a ``schedule()``, so none waits more than a step longer than without going ahead.
An adapter starving for a slot leaves it to ``schedule()`` too. Otherwise the engine schedules
the next step as before, after the update.

Sampling goes ahead whatever it reads of the token still being drawn: penalties, ``min_tokens``,
seeds and bad words read it on the device (``penalties.PendingLastTokens``). A grammar's
matcher must take it on the host before it allows the next token, so a step with such a row
computes its logits at launch and queues its draw once the step before is applied
(``pending_run.DeferredDraw``).
"""

from __future__ import annotations

from loraplex.engine.outputs import SchedulerOutput, ScheduledSeq
from loraplex.engine.sequence import Sequence, SequenceStatus


class ScheduleAhead:
    """``Scheduler.schedule_ahead`` (see module doc); a mixin of ``Scheduler``, using its queues,
    block manager, adapter gate, admission (``_admit``, ``_check_starvation``) and ``_output``."""

    def schedule_ahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """Step N+1 from step N (``prev``, launched, not yet updated), or None when it cannot go ahead."""
        if self.drafts is not None or (self.waiting and self._left_waiting):
            return None  # (the step ahead before this one left sequences waiting: schedule() places them)
        if not prev.scheduled:
            return None
        if self.waiting:
            self._check_starvation()  # picks S as schedule() would, which then handles it
        if self._starving is not None:
            return None
        # N's entries; those of sequences that ended since N was built (their rows in N are
        # dropped) are never looked up: schedule() leaves them out too
        entry_of = {entry.seq.seq_id: entry for entry in prev.scheduled}
        plan = self._plan_ahead(entry_of)
        if plan is None:
            return None
        self.stats.num_steps += 1
        self._first_admitted = []
        block_manager = self.block_manager
        scheduled: dict[int, ScheduledSeq] = {}
        budget = self.config.max_num_batched_tokens
        for seq, computed, num_tokens, pending in plan:
            seq.num_computed_tokens = computed  # as update() will set it
            block_manager.append(seq, num_tokens)
            if pending:  # a decode of the token N samples (not yet the sequence's: no _make_scheduled)
                tables = seq.block_tables
                scheduled[seq.seq_id] = ScheduledSeq(seq, computed, 1, tables[0], True, seq.adapter_id, [], tables)
            else:  # known tokens: a prompt's next chunk, as schedule() makes it
                scheduled[seq.seq_id] = self._make_scheduled(seq, num_tokens)
            budget -= num_tokens
        # waiting prompts are known: admitted here as schedule() would, adapters in slots only
        self._admit(scheduled, budget, placed_only=True)
        return self._output(scheduled)

    def _plan_ahead(self, entry_of: dict[int, ScheduledSeq]) -> list[tuple[Sequence, int, int, bool]] | None:
        """What ``schedule()`` after N's update would give each running sequence (``entry_of``:
        its entry in N) without preempting: (sequence, its computed tokens once N is applied,
        tokens in N+1, whether its token is the one N samples, not yet known).
        Decodes first, then the prompts' next chunks, each group in running order, within the
        token budget as there. None where N left a running sequence out (the scheduler's to
        place), blocks would run short, an adapter left its slot, or what N+1 computes depends
        on N's update."""
        block_manager = self.block_manager
        block_size = block_manager.block_size
        decodes, chunks = [], []
        adapters = set()
        need = 0  # new blocks per group
        for seq in self.running:  # (one pass: per sequence per step)
            entry = entry_of.get(seq.seq_id)
            if entry is None:
                return None
            adapters.add(seq.adapter_id)
            computed = entry.start_pos + entry.num_tokens
            if entry.needs_sample:
                decodes.append((seq, computed, 1, True))
            elif seq.needs_prompt_logprobs:
                return None  # which prompt positions N+1 reports depends on what N's update appends
            elif seq.num_tokens - computed == 1 and seq.output_token_ids:
                decodes.append((seq, computed, 1, False))  # a recompute's last token: schedule()'s decode
            else:  # N's chunk fell short of the prompt's end: the next one is of known tokens
                chunks.append((seq, computed))
                continue
            if computed // block_size >= len(seq.block_tables[0]):  # no room for position ``computed``
                need += 1
        adapters.discard(None)
        if adapters and self.adapter_gate is not None and not all(map(self.adapter_gate.is_placed, adapters)):
            return None  # an adapter left its slot: placing it again may fail, which a normal step handles
        budget = self.config.max_num_batched_tokens
        plan = decodes[:budget]  # one token each, as far as the budget goes
        budget -= len(plan)
        for seq, computed in chunks:
            if budget <= 0:
                break
            remaining = seq.num_tokens - computed
            num_tokens = min(remaining, budget)
            if not self._may_cut(remaining, num_tokens):
                continue
            plan.append((seq, computed, num_tokens, False))
            need += max(0, block_manager.blocks_for(computed + num_tokens) - len(seq.block_tables[0]))
            budget -= num_tokens
        if need * block_manager.num_groups > block_manager.num_free_blocks:
            return None  # the scheduler decides whom to preempt, after the update
        return plan
