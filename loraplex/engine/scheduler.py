"""Continuous-batching scheduler with chunked prefill, preemption by recompute and LoRA slot
admission. Pure Python: it never imports torch (a test asserts it).

Each ``schedule()`` builds one step under two budgets, ``max_num_batched_tokens`` tokens and
``max_num_seqs`` running sequences:

1. Running sequences, decodes first, then unfinished prompt chunks. A prompt longer than the
   remaining token budget is cut (chunked prefill) and continues next step. When a running
   sequence needs a KV block and none is free, a running sequence is preempted (its blocks
   freed, requeued by its arrival time, recomputed later from prompt + generated-so-far; its
   output is the same as without preemption). The policy (admission_order.py; kept up to date
   in running_set.py and waiting_queue.py) picks it: the most recently admitted under
   ``fcfs``; under ``fair`` (the default) one of the tenant holding the most running sequences
   for its weight (its lowest priority, newest).
2. Waiting sequences in the policy's order (``fcfs``: arrival; ``priority``: priority, then
   arrival; ``fair``: the tenant with the fewest running sequences for its weight, then within
   the tenant priority, then arrival), while budget, KV blocks and adapter slots allow. The
   first sequence that cannot get KV blocks stops admission (strict order for memory). A sequence whose adapter cannot
   get a slot, or is not loaded yet, is skipped without holding up the ones behind it.

A step's results are applied by ``update`` (step_results.py). ``schedule_ahead`` builds a plain
decode step from the one before it, before that one's tokens are back (schedule_ahead.py).

Adapter slots: the distinct adapters of the RUNNING sequences never exceed
``max_loras - gate.num_reserved_slots(running)``, so the runner can always place a step's
adapters in device slots.

Starvation bound: let S be the first waiting sequence (in the policy's order) whose adapter is
ready (in host memory) but cannot get a slot. From the step S is picked, no sequence of any
other adapter is admitted (base-model sequences still are: they take no slot), so the running
adapters drain; if S's adapter still has no slot ``config.lora_starvation_steps`` steps
later, every running sequence of the adapter with the fewest running sequences is preempted
(recomputed later) in that step. So S's adapter gets a slot, and S is admitted, at most
``lora_starvation_steps`` steps after S is picked, provided S fits in the free KV blocks and
the token budget (strict order for memory) and that explicitly pinned adapters do not hold
every slot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Protocol

from loraplex.config import EngineConfig
from loraplex.engine.admission_order import admission_order
from loraplex.engine.block_manager import BlockManager
from loraplex.engine.outputs import SchedulerOutput, ScheduledSeq
from loraplex.engine.running_set import RunningSet
from loraplex.engine.schedule_ahead import ScheduleAhead
from loraplex.engine.sequence import FINISH_STATUS, Sequence, SequenceStatus
from loraplex.engine.spec_drafts import DraftPlanner
from loraplex.engine.step_results import StepResults
from loraplex.speculative_config import parse_speculative_config
from loraplex.engine.waiting_queue import WaitingQueue


class AdapterGate(Protocol):
    """What the scheduler asks the LoRA manager (implemented by ``LoRAManager``)."""

    def is_ready(self, adapter_id: str) -> bool:
        """Validated and in host memory: giving it a slot needs no blocking I/O."""
        ...

    def num_reserved_slots(self, running: set[str]) -> int:
        """Device slots held by explicitly pinned adapters that are NOT in ``running``."""
        ...

    def is_placed(self, adapter_id: str) -> bool:
        """In a device slot now (``schedule_ahead`` runs only steps whose adapters are)."""
        ...


@dataclass
class SchedulerStats:
    """Cumulative counters (engine stats, tests)."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_chunked_prefills: int = 0
    num_starvation_preemptions: int = 0
    num_prompt_tokens_computed: int = 0
    # prefix cache (vLLM's prefix_cache_queries / _hits): prompt tokens looked up and found, at
    # each sequence's first admission only; a preempted sequence re-admitted mostly finds its
    # own recomputed blocks, which vLLM keeps out of the hit rate too; one that skips the lookup
    # (prompt logprobs) is not counted at all, as in vLLM
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_generated_tokens: int = 0
    # speculative decoding (vLLM's spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens)
    num_spec_drafts: int = 0  # sequence-steps that verified a non-empty draft
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0


class Scheduler(StepResults, ScheduleAhead):
    """Decides, step by step, which sequences run and how many tokens each (see module doc)."""

    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        adapter_gate: AdapterGate | None = None,
        eos_token_ids: Iterable[int] = (),
        max_model_len: int | None = None,
        reported_eos_token_ids: Iterable[int] = (),
    ):
        self.config = config
        self.block_manager = block_manager
        self.adapter_gate = adapter_gate
        self.eos_token_ids = frozenset(eos_token_ids)
        # EOS ids that end a sequence with themselves as stop_reason: the generation config's
        # beyond the tokenizer's own, which vLLM moves into stop_token_ids
        self.reported_eos_token_ids = frozenset(reported_eos_token_ids) & self.eos_token_ids
        self.max_model_len = max_model_len or config.max_model_len
        self.max_loras = config.max_loras
        # both keep the policy's order up to date as sequences come and go, so a step's
        # admissions cost O(offered log offered + tenants), not O(waiting)
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running = RunningSet(config.scheduling_policy)  # in admission order
        self._seqs: dict[int, Sequence] = {}  # unfinished sequences by id
        self._request_seqs: dict[str, set[int]] = {}  # request id -> its unfinished sequences' ids
        self._released: list[int] = []
        # sequences whose first admission was in the step being built (requeue_unrun forgets it)
        self._first_admitted: list[Sequence] = []
        self._starving: Sequence | None = None  # S of the module doc
        # a step ahead left sequences waiting: the next step is a schedule() (schedule_ahead.py)
        self._left_waiting = False
        self._starving_since = 0
        self.stats = SchedulerStats()
        spec = parse_speculative_config(config.speculative_config)
        # speculative decoding (None: off): decodes verify n-gram drafts (spec_drafts.py)
        self.drafts = DraftPlanner(spec, self.max_model_len) if spec is not None else None

    # ---- queue management ------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._seqs[seq.seq_id] = seq
        self._request_seqs.setdefault(seq.request_id, set()).add(seq.seq_id)
        self.waiting.add(seq)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get(self, seq_id: int) -> Sequence | None:
        return self._seqs.get(seq_id)

    def running_adapters(self) -> set[str]:
        return {s.adapter_id for s in self.running if s.adapter_id is not None}

    # ---- step building ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.stats.num_steps += 1
        self._first_admitted = []
        budget = self.config.max_num_batched_tokens
        scheduled: dict[int, ScheduledSeq] = {}
        num_preempted = 0

        self._check_starvation()
        if self._starving is not None and self._starving_steps() >= self.config.lora_starvation_steps:
            num_preempted += self._preempt_for_starving()
        num_preempted_for_kv = 0

        # 1. running: decodes first, then prompt chunks (each group in running order). A decode
        # (only its last token lacks KV) takes one token, or 1 + a draft: its own loop spares
        # the general one's sums and checks, per sequence per step
        decodes: list[Sequence] = []
        others: list[Sequence] = []
        for seq in self.running:
            out = seq.output_token_ids  # Sequence.is_decode, spelled out
            if len(seq.prompt_token_ids) + len(out) - seq.num_computed_tokens == 1 and out:
                decodes.append(seq)
            else:
                others.append(seq)
        # drafts get what the budget has left after one token for every decode: a short budget
        # shrinks drafts instead of leaving decodes out
        decodes_left = len(decodes)
        drafts, block_manager = self.drafts, self.block_manager
        running_status = SequenceStatus.RUNNING
        for seq in decodes:
            if seq.status is not running_status:
                continue  # preempted earlier in this loop
            if budget <= 0:
                break
            draft: list[int] = []
            if drafts is not None:
                decodes_left -= 1
                draft = drafts.draft(seq, budget - 1 - decodes_left)
                if draft and not block_manager.can_append(seq, 1 + len(draft)):
                    draft = []  # memory is short: drop the draft rather than preempt for it
            num_tokens = 1 + len(draft)
            if not block_manager.can_append(seq, num_tokens):
                freed, preempted = self._make_room(scheduled, seq, num_tokens)
                budget += freed
                num_preempted_for_kv += preempted
                if seq.status is not running_status:
                    continue
            block_manager.append(seq, num_tokens)
            # _make_scheduled's entry: a decode's chunk reaches the end of the known tokens
            tables = seq.block_tables
            scheduled[seq.seq_id] = ScheduledSeq(seq, seq.num_computed_tokens, num_tokens, tables[0], True,
                                                 seq.adapter_id, draft, tables)
            budget -= num_tokens
        for seq in others:
            if seq.status is not running_status:
                continue  # preempted earlier in this loop
            if budget <= 0:
                break
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if not self._may_cut(seq.num_uncomputed_tokens, num_tokens):
                continue
            if not block_manager.can_append(seq, num_tokens):
                freed, preempted = self._make_room(scheduled, seq, num_tokens)
                budget += freed
                num_preempted_for_kv += preempted
                if seq.status is not running_status:
                    continue
            block_manager.append(seq, num_tokens)
            scheduled[seq.seq_id] = self._make_scheduled(seq, num_tokens)
            budget -= num_tokens

        # 2. waiting, in the policy's order; adapter-blocked ones are skipped, KV-blocked stop
        # admission.
        # No admission in a step that had to preempt for KV: memory is short already.
        num_preempted += num_preempted_for_kv
        if num_preempted_for_kv == 0:
            budget = self._admit(scheduled, budget)
        self._left_waiting = False
        return self._output(scheduled, num_preempted)

    def _output(self, scheduled: dict[int, ScheduledSeq], num_preempted: int = 0) -> SchedulerOutput:
        """The step of ``scheduled``'s entries, with the sequences released since the last one."""
        entries = list(scheduled.values())
        num_batched_tokens = num_chunked_prefills = num_draft_tokens = 0
        for e in entries:  # one pass for the three sums
            num_batched_tokens += e.num_tokens
            num_chunked_prefills += not e.needs_sample
            num_draft_tokens += len(e.draft_token_ids)
        out = SchedulerOutput(
            scheduled=entries,
            num_batched_tokens=num_batched_tokens,
            released_seq_ids=self._released,
            num_preempted=num_preempted,
            num_chunked_prefills=num_chunked_prefills,
            num_draft_tokens=num_draft_tokens,
        )
        self._released = []
        self.stats.num_preemptions += num_preempted
        self.stats.num_chunked_prefills += out.num_chunked_prefills
        return out

    def _admit(self, scheduled: dict[int, ScheduledSeq], budget: int, placed_only: bool = False) -> int:
        """Admit waiting sequences into the step being built; returns the budget left.
        ``placed_only``: only those of the base model or of an adapter in a device slot now
        (a step ahead loads nothing); it sets ``_left_waiting`` when something other than the
        token budget, which ``schedule()`` after the update would have the same of, held a
        waiting sequence back (seats, blocks and adapter slots that sequences ending in the step
        before may free, or an adapter to place)."""
        held = False  # a waiting sequence held back by something other than the token budget
        # (ordering thousands of waiting sequences for nothing costs a step time)
        if budget > 0 and self.waiting:
            if len(self.running) >= self.config.max_num_seqs:
                held = True
            else:
                budget, held = self._admit_in_order(scheduled, budget, placed_only)
        if placed_only:
            self._left_waiting = held and bool(self.waiting)
        return budget

    def _admit_in_order(self, scheduled: dict[int, ScheduledSeq], budget: int, placed_only: bool
                        ) -> tuple[int, bool]:
        """``_admit``'s walk over the waiting sequences in admission order; returns the budget
        left and whether something other than the token budget held one back."""
        held = False
        adapters = self.running_adapters()
        for seq in self.waiting.admission_order(self.running):
            if budget <= 0:
                break
            if len(self.running) >= self.config.max_num_seqs:
                held = True
                break
            if not self._adapter_admissible(seq, adapters):
                held = True
                continue
            if (placed_only and seq.adapter_id is not None and self.adapter_gate is not None
                    and not self.adapter_gate.is_placed(seq.adapter_id)):
                held = True
                continue
            cached = self.block_manager.num_cached_prefix_tokens(seq)
            num_tokens = min(seq.num_tokens - cached, budget)
            if not self._may_cut(seq.num_tokens - cached, num_tokens):
                break
            if not self.block_manager.can_allocate(seq, num_tokens):
                held = True
                break
            self.block_manager.allocate(seq, num_tokens)
            if seq.num_cached_tokens is None:  # the first admission's hits (vLLM's num_cached_tokens)
                seq.num_cached_tokens = seq.num_computed_tokens
                self._first_admitted.append(seq)
                self._count_prefix_lookup(seq, 1)
            seq.status = SequenceStatus.RUNNING
            seq.admitted_time = time.monotonic()
            self.waiting.discard(seq)
            self.running.add(seq)
            if seq.adapter_id is not None:
                adapters.add(seq.adapter_id)
            if seq is self._starving:
                self._starving = None
            scheduled[seq.seq_id] = self._make_scheduled(seq, num_tokens)
            budget -= num_tokens
        return budget, held

    def _count_prefix_lookup(self, seq: Sequence, sign: int) -> None:
        """Add (``sign`` 1) or take back (-1) a first admission's prefix-cache lookup. A sequence
        that skipped the lookup (prompt logprobs) is no query, as in vLLM
        (``KVCacheManager.record_prefix_cache_stats``); a take-back follows a step that never ran,
        so its prompt logprobs, and the answer, are still those of the admission."""
        if self.block_manager.reads_prefix_cache(seq):
            self.stats.num_prefix_query_tokens += sign * seq.num_tokens
            self.stats.num_prefix_hit_tokens += sign * seq.num_cached_tokens

    def _may_cut(self, remaining: int, num_tokens: int) -> bool:
        """Without chunked prefill a prompt runs whole; only a recompute after preemption that
        can never fit one step (prompt + generated > max_num_batched_tokens) is cut."""
        if num_tokens == remaining or self.config.enable_chunked_prefill:
            return True
        return remaining > self.config.max_num_batched_tokens

    def _adapter_admissible(self, seq: Sequence, adapters: set[str]) -> bool:
        adapter = seq.adapter_id
        if adapter is None or adapter in adapters:
            # an adapter already running needs no new slot, but while S starves its running
            # adapters must drain (see module doc)
            return adapter is None or self._starving is None or self._starving.adapter_id == adapter
        if self._starving is not None and self._starving.adapter_id != adapter:
            return False
        if self.adapter_gate is not None and not self.adapter_gate.is_ready(adapter):
            return False
        return self._fits_slots(adapters | {adapter})

    def _fits_slots(self, adapters: set[str]) -> bool:
        reserved = self.adapter_gate.num_reserved_slots(adapters) if self.adapter_gate else 0
        return len(adapters) <= self.max_loras - reserved

    # ---- starvation ------------------------------------------------------------------------
    def _check_starvation(self) -> None:
        """Keep or pick S: the first waiting sequence whose ready adapter cannot get a slot."""
        starving = self._starving
        if starving is not None:
            still_waiting = starving.status is SequenceStatus.WAITING and starving.seq_id in self._seqs
            not_ready = self.adapter_gate is not None and not self.adapter_gate.is_ready(starving.adapter_id)
            if still_waiting and not not_ready:
                return
            self._starving = None
        if not self.waiting.adapters():
            return  # nothing waits for a slot (running_adapters is a pass over every running sequence)
        adapters = self.running_adapters()
        # Only sequences that would need a new slot can starve, and S is the first of them (in
        # the policy's order over just those) whose adapter is ready, if that adapter cannot get
        # a slot. When every ready adapter can, or none is ready, there is no S whatever the
        # order: the order, O(candidates), is only worked out when some ready adapter cannot.
        wanted = [a for a in self.waiting.adapters() if a not in adapters]
        fits = {a: self._fits_slots(adapters | {a}) for a in wanted
                if self.adapter_gate is None or self.adapter_gate.is_ready(a)}
        if all(fits.values()):
            return
        candidates = self.waiting.with_adapters(wanted)
        for seq in admission_order(candidates, self.running, self.config.scheduling_policy):
            if seq.adapter_id not in fits:
                continue  # not ready
            if not fits[seq.adapter_id]:
                self._starving = seq
                self._starving_since = self.stats.num_steps
            return

    def _starving_steps(self) -> int:
        return self.stats.num_steps - self._starving_since

    def _preempt_for_starving(self) -> int:
        """Free one slot for S by preempting all running sequences of the least used adapter."""
        counts: dict[str, int] = {}
        for seq in self.running:
            if seq.adapter_id is not None:
                counts[seq.adapter_id] = counts.get(seq.adapter_id, 0) + 1
        if not counts:
            return 0  # slots are held by pinned adapters; nothing the scheduler can preempt
        victim_adapter = min(counts, key=lambda a: (counts[a], a))
        victims = [s for s in self.running if s.adapter_id == victim_adapter]
        for seq in reversed(victims):
            self._preempt(seq)
        self.stats.num_starvation_preemptions += len(victims)
        self._starving_since = self.stats.num_steps  # the bound restarts if still not enough
        return len(victims)

    # ---- preemption / release --------------------------------------------------------------
    def _make_scheduled(self, seq: Sequence, num_tokens: int, draft: list[int] | None = None) -> ScheduledSeq:
        start = seq.num_computed_tokens
        draft = draft or []
        return ScheduledSeq(
            seq=seq,
            start_pos=start,
            num_tokens=num_tokens,
            block_table=seq.block_tables[0],
            needs_sample=start + num_tokens - len(draft) == seq.num_tokens,
            adapter_id=seq.adapter_id,
            draft_token_ids=draft,
            block_tables=seq.block_tables,
        )

    def _make_room(self, scheduled: dict[int, ScheduledSeq], seq: Sequence, num_tokens: int) -> tuple[int, int]:
        """Preempt running sequences (the policy's victims, last first) until ``seq`` can append
        ``num_tokens`` or is itself preempted; (budget given back by unscheduled victims, number
        preempted)."""
        freed = preempted = 0
        while not self.block_manager.can_append(seq, num_tokens):
            victim = self.running.preemption_victim()
            freed += self._unschedule(scheduled, victim)
            self._preempt(victim)
            preempted += 1
            if victim is seq:
                break
        return freed, preempted

    @staticmethod
    def _unschedule(scheduled: dict[int, ScheduledSeq], seq: Sequence) -> int:
        entry = scheduled.pop(seq.seq_id, None)
        return entry.num_tokens if entry else 0

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self.running.remove(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self._released.append(seq.seq_id)
        self.waiting.add(seq)

    def requeue_unrun(self, sched_out: SchedulerOutput) -> None:
        """After a step that did not run (an adapter could not be placed): with prefix caching,
        its blocks were registered in the cache as if computed, and a sequence admitted in the
        same step may count one of them as a prefix hit. Every still-running sequence of the
        step therefore goes back to waiting (recomputed from scratch; ``free`` unregisters what
        was never computed). Without prefix caching nothing was registered: they just run again."""
        if not self.block_manager.enable_prefix_caching:
            # nothing was registered or counted, and the sequences stay running: their admission
            # stands (re-admitted never, a count reset here would stay unknown for good)
            self._first_admitted = []
            return
        # an admission whose step never ran did not happen: the hits it counted may be blocks that
        # step registered and never computed; the admission that runs counts again
        for seq in self._first_admitted:
            self._count_prefix_lookup(seq, -1)  # nothing was generated: the same num_tokens
            seq.num_cached_tokens = None
        self._first_admitted = []
        for entry in reversed(sched_out.scheduled):
            if entry.seq.status is SequenceStatus.RUNNING:
                self._preempt(entry.seq)

    def _release(self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None = None) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.discard(seq)
        self.block_manager.free(seq)
        seq.status = status
        seq.stop_reason = stop_reason
        seq.finished_time = time.monotonic()
        if self._seqs.pop(seq.seq_id, None) is not None:
            siblings = self._request_seqs[seq.request_id]
            siblings.discard(seq.seq_id)
            if not siblings:
                del self._request_seqs[seq.request_id]
        self._released.append(seq.seq_id)

    def finish(self, seq_id: int, reason: str, stop_reason: int | str | None = None) -> None:
        """End a sequence now (the engine's stop-string check): ``reason`` is stop/length/abort."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
            self._release(seq, FINISH_STATUS[reason], stop_reason)

    def abort(self, request_id: str) -> list[Sequence]:
        """Abort every sequence of a request; their blocks are free when this returns."""
        # by index, not a scan of every unfinished sequence: clients that hang up under a long
        # queue abort one request each, which must not cost O(queue) apiece
        seqs = [self._seqs[i] for i in sorted(self._request_seqs.get(request_id, ()))]
        for seq in seqs:
            self._release(seq, SequenceStatus.FINISHED_ABORTED)
        return seqs
