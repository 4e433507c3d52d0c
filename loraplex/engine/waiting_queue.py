"""The waiting sequences, kept in the scheduling policy's order as they come and go, so that a
step offering k of them admission costs O(k log k + T) for T tenants with waiting work (plus
O(k log T) for the tenant heap under ``fair``), not O(waiting). Pure Python, no torch.

The order is the one stated in admission_order.py, whose list-based ``admission_order`` computes
it from scratch (the tests hold this queue to it). Each entry into the queue, an arrival or a
requeue after preemption, draws a ticket from a counter; as a list the queue is in
(arrival_time, ticket) order, so a preempted sequence goes back after the waiting ones of its
own arrival time and before every later arrival.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Iterable, Iterator

from loraplex.engine import lazy_heap
from loraplex.engine.running_set import RunningSet
from loraplex.engine.sequence import Sequence, SequenceStatus


class _Group:
    """The waiting sequences offered admission as one queue: a tenant's under ``fair``, all of
    them under ``fcfs`` and ``priority``. Heap entries end with (ticket, seq), see lazy_heap."""

    __slots__ = ("order", "by_arrival", "newest", "size")

    def __init__(self):
        self.order: list[tuple] = []  # the group's admission order: (arrival,) or (priority, arrival)
        self.by_arrival: list[tuple] = []  # fair: the group's first in the list's order (tie-break)
        self.newest: list[tuple] = []  # fair: its latest arrival (whose weight counts), as a min-heap
        self.size = 0

    def heaps(self) -> tuple[list[tuple], ...]:
        return self.order, self.by_arrival, self.newest


class WaitingQueue:
    """Sequences waiting for admission under one scheduling policy: ``add`` on arrival or
    requeue, ``discard`` on admission, finish or abort, ``admission_order`` for the step.
    Iterating it gives the sequences in list order (arrival, then entry)."""

    def __init__(self, policy: str):
        self.policy = policy
        self._fair = policy == "fair"
        self._tickets = itertools.count()
        self._live: dict[int, Sequence] = {}  # ticket -> sequence
        self._ticket_of: dict[int, int] = {}  # seq_id -> ticket
        self._groups: dict[str | None, _Group] = {}  # by tenant under fair; one group, None, otherwise
        self._by_adapter: dict[str, dict[int, Sequence]] = {}  # adapter -> {ticket: seq}
        self._version = 0  # bumped by add: admission_order refuses to go on over a changed heap

    # ---- membership --------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self._ticket_of:
            raise ValueError(f"sequence {seq.seq_id} is waiting already")
        ticket = next(self._tickets)
        self._live[ticket] = seq
        self._ticket_of[seq.seq_id] = ticket
        group = self._groups.get(self._group_key(seq))
        if group is None:
            group = self._groups[self._group_key(seq)] = _Group()
        group.size += 1
        if self.policy == "fcfs":
            heapq.heappush(group.order, (seq.arrival_time, ticket, seq))
        else:
            heapq.heappush(group.order, (seq.priority, seq.arrival_time, ticket, seq))
        if self._fair:
            heapq.heappush(group.by_arrival, (seq.arrival_time, ticket, seq))
            heapq.heappush(group.newest, (-seq.arrival_time, -seq.seq_id, ticket, seq))
        if seq.adapter_id is not None:
            self._by_adapter.setdefault(seq.adapter_id, {})[ticket] = seq
        self._version += 1

    def discard(self, seq: Sequence) -> None:
        """Take ``seq`` out if it is waiting (O(1) amortized); safe during ``admission_order``."""
        ticket = self._ticket_of.get(seq.seq_id)
        if ticket is None or self._live[ticket] is not seq:
            return
        del self._ticket_of[seq.seq_id]
        del self._live[ticket]
        key = self._group_key(seq)
        group = self._groups[key]
        group.size -= 1
        if group.size == 0:
            del self._groups[key]
        elif any(lazy_heap.needs_compaction(heap, group.size) for heap in group.heaps()):
            # new lists: a running admission_order keeps walking the old ones
            group.order, group.by_arrival, group.newest = (lazy_heap.compacted(h, self._live) for h in group.heaps())
        if seq.adapter_id is not None:
            same_adapter = self._by_adapter[seq.adapter_id]
            del same_adapter[ticket]
            if not same_adapter:
                del self._by_adapter[seq.adapter_id]

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __contains__(self, seq: Sequence) -> bool:
        ticket = self._ticket_of.get(seq.seq_id)
        return ticket is not None and self._live[ticket] is seq

    def __iter__(self) -> Iterator[Sequence]:
        """In list order: O(n log n), for stats and tests, not for the step."""
        return iter(self._in_list_order(self._live.items()))

    def _group_key(self, seq: Sequence) -> str | None:
        return seq.tenant if self._fair else None

    @staticmethod
    def _in_list_order(items: Iterable[tuple[int, Sequence]]) -> list[Sequence]:
        return [seq for _, seq in sorted(items, key=lambda item: (item[1].arrival_time, item[0]))]

    # ---- adapters (the scheduler's LoRA starvation check) ------------------------------------
    def adapters(self) -> Iterable[str]:
        """The adapters of the waiting sequences (base-model ones have none)."""
        return self._by_adapter.keys()

    def with_adapters(self, adapters: Iterable[str]) -> list[Sequence]:
        """The waiting sequences of ``adapters``, in list order."""
        return self._in_list_order(item for a in adapters for item in self._by_adapter.get(a, {}).items())

    # ---- the step's order --------------------------------------------------------------------
    def admission_order(self, running: RunningSet) -> Iterator[Sequence]:
        """Yield the waiting sequences best first, as ``admission_order.admission_order`` does
        for the policy. Lazy: a sequence the caller admitted (status RUNNING, and ``discard``ed
        from here) before asking for the next one counts toward its tenant's running load for
        the ones after it. The caller must not ``add`` while this runs."""
        if not self._fair:
            group = self._groups.get(None)
            if group is not None:
                lazy_heap.top(group.order, self._live)  # drop the admitted ones at the front
                yield from self._checked(lazy_heap.in_order(group.order, self._live))
            return
        yield from self._checked(self._fair_order(running))

    def _checked(self, order: Iterator[Sequence]) -> Iterator[Sequence]:
        version = self._version
        for seq in order:
            yield seq
            if self._version != version:
                raise RuntimeError("a sequence was added to the waiting queue during admission")

    def _fair_order(self, running: RunningSet) -> Iterator[Sequence]:
        # A heap of tenants keyed (weighted load, arrival of the tenant's next, tie-break). The
        # tie-break is, for each tenant's first entry, its earliest sequence in list order
        # (the list-based statement meets tenants in that order) and for the entries pushed
        # later, the push order after all first entries. This loop is the O(T) of a step, so
        # it reads each group's heap tops inline rather than through lazy_heap.top's calls.
        live = self._live
        loads: dict[str | None, int] = {}
        weights: dict[str | None, float] = {}
        orders: dict[str | None, list[tuple]] = {}
        tenants = []
        for tenant, group in self._groups.items():
            order, by_arrival, newest = group.order, group.by_arrival, group.newest
            if order[0][-2] not in live:
                lazy_heap.top(order, live)
            if by_arrival[0][-2] not in live:
                lazy_heap.top(by_arrival, live)
            if newest[0][-2] not in live:
                lazy_heap.top(newest, live)
            head, earliest, latest = order[0][-1], by_arrival[0], newest[0][-1]
            count, latest_running = running.count_and_latest(tenant)
            if latest_running is not None and ((latest_running.arrival_time, latest_running.seq_id)
                                               >= (latest.arrival_time, latest.seq_id)):
                latest = latest_running  # the weight is the one of the latest arrival, either side
            loads[tenant], weights[tenant], orders[tenant] = count, latest.tenant_weight, order
            tenants.append((count / latest.tenant_weight, head.arrival_time, (0, earliest[0], earliest[1]),
                            head, tenant))
        heapq.heapify(tenants)
        cursors: dict[str | None, Iterator[Sequence]] = {}  # made for the tenants popped only
        pushes = itertools.count()
        while tenants:
            *_, seq, tenant = heapq.heappop(tenants)
            yield seq
            if seq.status is SequenceStatus.RUNNING:
                loads[tenant] += 1
            cursor = cursors.get(tenant)
            if cursor is None:  # the first pop was the head, orders[tenant][0]
                cursor = cursors[tenant] = lazy_heap.in_order(orders[tenant], live, after_top=True)
            following = next(cursor, None)
            if following is not None:
                heapq.heappush(tenants, (loads[tenant] / weights[tenant], following.arrival_time, (1, next(pushes)),
                                         following, tenant))
