"""The list-based scheduler of before WaitingQueue and RunningSet, as a reference for the
scheduler-level differential test: the waiting queue a plain list in arrival order (a preempted
sequence requeued after the waiting ones of its arrival time), the order and victim worked out
from scratch by admission_order.py's list-based functions each step, and the LoRA starvation
check as it was (every waiting sequence scanned, the candidates ordered)."""

from __future__ import annotations

from loraplex.engine.admission_order import admission_order, preemption_victim
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.sequence import Sequence, SequenceStatus


class ListWaiting:
    """WaitingQueue's interface over a list."""

    def __init__(self, policy: str):
        self.policy = policy
        self.seqs: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        for i, other in enumerate(self.seqs):
            if seq.arrival_time < other.arrival_time:
                self.seqs.insert(i, seq)
                return
        self.seqs.append(seq)

    def discard(self, seq: Sequence) -> None:
        if seq in self.seqs:  # identity: Sequence has eq=False
            self.seqs.remove(seq)

    def __len__(self) -> int:
        return len(self.seqs)

    def __iter__(self):
        return iter(list(self.seqs))

    def admission_order(self, running):
        return admission_order(list(self.seqs), list(running), self.policy)


class ListRunning(list):
    """RunningSet's interface over a list in admission order."""

    def __init__(self, policy: str):
        super().__init__()
        self.policy = policy

    def add(self, seq: Sequence) -> None:
        self.append(seq)

    def preemption_victim(self) -> Sequence:
        return preemption_victim(self, self.policy)


class ListScheduler(Scheduler):
    """The scheduler with the list-based queue, order, victim and starvation check."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.waiting = ListWaiting(self.config.scheduling_policy)
        self.running = ListRunning(self.config.scheduling_policy)

    def _check_starvation(self) -> None:
        starving = self._starving
        if starving is not None:
            still_waiting = starving.status is SequenceStatus.WAITING and starving.seq_id in self._seqs
            not_ready = self.adapter_gate is not None and not self.adapter_gate.is_ready(starving.adapter_id)
            if still_waiting and not not_ready:
                return
            self._starving = None
        adapters = self.running_adapters()
        candidates = [s for s in self.waiting if s.adapter_id is not None and s.adapter_id not in adapters]
        for seq in admission_order(candidates, self.running, self.config.scheduling_policy):
            adapter = seq.adapter_id
            if self.adapter_gate is not None and not self.adapter_gate.is_ready(adapter):
                continue
            if not self._fits_slots(adapters | {adapter}):
                self._starving = seq
                self._starving_since = self.stats.num_steps
            return
