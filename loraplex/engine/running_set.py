"""The running sequences in admission order, with what the scheduling policy asks of them kept
as they are admitted and leave: each tenant's count and latest arrival (for ``fair``'s weighted
load) and the preemption victim's candidates, so that picking a victim costs O(T) for T
running tenants (O(1) amortized under ``fcfs`` and ``priority``), not O(running).
Pure Python, no torch.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Iterator

from loraplex.engine import lazy_heap
from loraplex.engine.sequence import Sequence


class _TenantRunning:
    """One tenant's running sequences. Heap entries end with (admission number, seq)."""

    __slots__ = ("count", "newest", "victims")

    def __init__(self):
        self.count = 0
        self.newest: list[tuple] = []  # its latest arrival first (whose weight counts)
        self.victims: list[tuple] = []  # fair: its highest priority value, latest admitted, first


class RunningSet:
    """Running sequences in admission order under one scheduling policy: ``add`` on admission,
    ``remove`` on preemption or finish. Indexing and iteration are the admission order's."""

    def __init__(self, policy: str):
        self.policy = policy
        self._seqs: list[Sequence] = []  # admission order
        self._numbers = itertools.count()
        self._live: dict[int, Sequence] = {}  # admission number -> sequence
        self._number_of: dict[int, int] = {}  # seq_id -> admission number
        self._tenants: dict[str | None, _TenantRunning] = {}
        self._victims: list[tuple] = []  # priority: the highest priority value, latest admitted, first

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self._number_of:
            raise ValueError(f"sequence {seq.seq_id} is running already")
        number = next(self._numbers)
        self._seqs.append(seq)
        self._live[number] = seq
        self._number_of[seq.seq_id] = number
        tenant = self._tenants.get(seq.tenant)
        if tenant is None:
            tenant = self._tenants[seq.tenant] = _TenantRunning()
        tenant.count += 1
        heapq.heappush(tenant.newest, (-seq.arrival_time, -seq.seq_id, number, seq))
        victim_entry = (-seq.priority, -number, number, seq)
        if self.policy == "fair":
            heapq.heappush(tenant.victims, victim_entry)
        elif self.policy == "priority":
            heapq.heappush(self._victims, victim_entry)

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out; ValueError if it is not running (as ``list.remove``)."""
        self._seqs.remove(seq)
        number = self._number_of.pop(seq.seq_id)
        del self._live[number]
        tenant = self._tenants[seq.tenant]
        tenant.count -= 1
        if tenant.count == 0:
            del self._tenants[seq.tenant]
        else:
            if lazy_heap.needs_compaction(tenant.newest, tenant.count):
                tenant.newest = lazy_heap.compacted(tenant.newest, self._live)
            if lazy_heap.needs_compaction(tenant.victims, tenant.count):
                tenant.victims = lazy_heap.compacted(tenant.victims, self._live)
        if lazy_heap.needs_compaction(self._victims, len(self._seqs)):
            self._victims = lazy_heap.compacted(self._victims, self._live)

    def __len__(self) -> int:
        return len(self._seqs)

    def __bool__(self) -> bool:
        return bool(self._seqs)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)

    def __getitem__(self, index: int) -> Sequence:
        return self._seqs[index]

    def __contains__(self, seq: Sequence) -> bool:
        number = self._number_of.get(seq.seq_id)
        return number is not None and self._live[number] is seq

    def count(self, tenant: str | None) -> int:
        """How many of ``tenant``'s sequences run."""
        running = self._tenants.get(tenant)
        return running.count if running is not None else 0

    def count_and_latest(self, tenant: str | None) -> tuple[int, Sequence | None]:
        """How many of ``tenant``'s sequences run, and its latest arrived one (the later seq id
        among equal arrivals), whose weight counts."""
        running = self._tenants.get(tenant)
        if running is None:
            return 0, None
        return running.count, lazy_heap.top(running.newest, self._live)[-1]

    def preemption_victim(self) -> Sequence:
        """The running sequence to preempt, as ``admission_order.preemption_victim`` picks it."""
        if not self._seqs:
            raise ValueError("no running sequence to preempt")
        if self.policy == "fcfs":
            return self._seqs[-1]
        if self.policy == "priority":
            return lazy_heap.top(self._victims, self._live)[-1]
        best_key, best = None, None
        for running in self._tenants.values():
            weight = lazy_heap.top(running.newest, self._live)[-1].tenant_weight
            priority, later, *_, seq = lazy_heap.top(running.victims, self._live)
            key = (running.count / weight, -priority, -later)
            if best_key is None or key > best_key:
                best_key, best = key, seq
        return best
