"""WaitingQueue and RunningSet, the incremental admission order and preemption victim, against
two references over random runs of arrive / admit / preempt / finish / abort events with random
tenants (and none), priorities, weights that change mid-run and tied arrival times:

- a brute-force statement of each policy, tie-breaks included, over a plain list kept as the
  list-based scheduler kept its waiting queue (arrival order; a preempted sequence goes back
  after the waiting ones of its arrival time);
- the list-based ``admission_order`` / ``preemption_victim`` of admission_order.py, which
  test_fair_scheduling.py holds to the stated rules on distinct arrival times.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from loraplex.engine import lazy_heap
from loraplex.engine.admission_order import admission_order, preemption_victim
from loraplex.engine.running_set import RunningSet
from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.engine.waiting_queue import WaitingQueue
from loraplex.sampling_params import SamplingParams

POLICIES = ("fair", "fcfs", "priority")


def insert_waiting(waiting: list[Sequence], seq: Sequence) -> None:
    """The list-based scheduler's requeue: before the first sequence that arrived strictly later."""
    for i, other in enumerate(waiting):
        if seq.arrival_time < other.arrival_time:
            waiting.insert(i, seq)
            return
    waiting.append(seq)


def stated_weights(seqs) -> dict:
    """Each tenant's weight: the one on its latest arrival (the later seq id among equals)."""
    latest = {}
    for seq in seqs:
        key = (seq.arrival_time, seq.seq_id)
        if seq.tenant not in latest or key > latest[seq.tenant][0]:
            latest[seq.tenant] = (key, seq.tenant_weight)
    return {tenant: weight for tenant, (_, weight) in latest.items()}


def stated_order(waiting: list[Sequence], running: list[Sequence], policy: str, admit) -> list[Sequence]:
    """Each policy as stated, one pick at a time; ``waiting`` is in list order. fcfs: list
    order. priority: (priority, list position). fair: the tenant with the least (running / weight,
    arrival of its best request, tie-break), its best being its least (priority, list position);
    the tie-break of a tenant not picked yet is its first list position, after which a tenant
    ranks by when it was last picked, behind every tenant not picked yet."""
    position = {s.seq_id: i for i, s in enumerate(waiting)}
    if policy == "fcfs":
        picks = list(waiting)
    elif policy == "priority":
        picks = sorted(waiting, key=lambda s: (s.priority, position[s.seq_id]))
    else:
        picks = []
        load = Counter(s.tenant for s in running)
        weight = stated_weights(list(running) + list(waiting))
        queues: dict = {}
        for seq in waiting:
            queues.setdefault(seq.tenant, []).append(seq)
        for queue in queues.values():
            queue.sort(key=lambda s: (s.priority, position[s.seq_id]))
        tiebreak = {t: (0, min(position[s.seq_id] for s in q)) for t, q in queues.items()}
        for n in itertools.count():
            left = [t for t, q in queues.items() if q]
            if not left:
                break
            tenant = min(left, key=lambda t: (load[t] / weight[t], queues[t][0].arrival_time, tiebreak[t]))
            seq = queues[tenant].pop(0)
            picks.append(seq)
            if admit(seq):
                load[tenant] += 1
            tiebreak[tenant] = (1, n)
    return picks


def stated_victim(running: list[Sequence], policy: str) -> Sequence:
    if policy == "fcfs":
        return running[-1]
    if policy == "priority":
        return running[max(range(len(running)), key=lambda i: (running[i].priority, i))]
    load = Counter(s.tenant for s in running)
    weight = stated_weights(running)
    return running[max(range(len(running)),
                       key=lambda i: (load[running[i].tenant] / weight[running[i].tenant], running[i].priority, i))]


class Run:
    """The structures under test and the plain lists, driven by the same random events."""

    def __init__(self, policy: str, rng: random.Random):
        self.policy, self.rng = policy, rng
        self.queue, self.running = WaitingQueue(policy), RunningSet(policy)
        self.ref_waiting: list[Sequence] = []
        self.ref_running: list[Sequence] = []
        self.tenants = ["a", "b", "c", "d", None][: rng.randint(1, 5)]
        self.share = {t: rng.choice([0.5, 1.0, 1.0, 2.0, 3.0]) for t in self.tenants}
        self.ids = itertools.count()
        self.clock = 0.0

    def arrive(self) -> None:
        rng = self.rng
        if rng.random() < 0.6:
            self.clock += rng.choice([0.5, 1.0])  # else the same arrival time as the previous one
        if rng.random() < 0.05:  # an operator changes a tenant's weight
            self.share[rng.choice(self.tenants)] = rng.choice([0.25, 1.5, 4.0])
        tenant = rng.choice(self.tenants)
        seq = Sequence(seq_id=next(self.ids), request_id="r", prompt_token_ids=[1], params=SamplingParams(),
                       tenant=tenant, priority=rng.choice([0, 0, 0, -1, 2]), tenant_weight=self.share[tenant],
                       arrival_time=self.clock, adapter_id=rng.choice([None, "x", "y"]))
        self.queue.add(seq)
        self.ref_waiting.append(seq)  # never earlier than a waiting one: the same as insert_waiting

    def admit(self) -> None:
        """Offer admission like the scheduler: admit some, skip others, stop at some point."""
        rng = self.rng
        p_admit, stop_after = rng.choice([0.3, 0.7, 1.0]), rng.randint(0, 12)
        decisions, offered = {}, []
        for seq in self.queue.admission_order(self.running):
            if len(offered) == stop_after:
                break
            offered.append(seq)
            decisions[seq.seq_id] = rng.random() < p_admit
            if decisions[seq.seq_id]:
                seq.status = SequenceStatus.RUNNING
                self.queue.discard(seq)
                self.running.add(seq)
        for seq in offered:  # back as they were, for the references
            seq.status = SequenceStatus.WAITING

        def admit(seq):
            return decisions.get(seq.seq_id, False)

        stated = stated_order(self.ref_waiting, self.ref_running, self.policy, admit)
        listed = []
        for seq in admission_order(self.ref_waiting, self.ref_running, self.policy):
            if len(listed) == len(offered):
                break
            listed.append(seq)
            if admit(seq):
                seq.status = SequenceStatus.RUNNING
        assert [s.seq_id for s in offered] == [s.seq_id for s in stated[: len(offered)]]
        assert [s.seq_id for s in offered] == [s.seq_id for s in listed]
        for seq in offered:
            if admit(seq):
                self.ref_waiting.remove(seq)
                self.ref_running.append(seq)

    def preempt(self) -> None:
        if not self.ref_running:
            return
        victim = self.running.preemption_victim()
        assert victim is stated_victim(self.ref_running, self.policy)
        assert victim is preemption_victim(self.ref_running, self.policy)
        self.running.remove(victim)
        self.ref_running.remove(victim)
        victim.status = SequenceStatus.WAITING
        self.queue.add(victim)
        insert_waiting(self.ref_waiting, victim)

    def finish(self) -> None:
        if self.ref_running:
            seq = self.rng.choice(self.ref_running)
            self.running.remove(seq)
            self.ref_running.remove(seq)
            seq.status = SequenceStatus.FINISHED_STOPPED

    def abort(self) -> None:
        pool = self.ref_waiting + self.ref_running
        if not pool:
            return
        seq = self.rng.choice(pool)
        if seq.status is SequenceStatus.WAITING:
            self.queue.discard(seq)
            self.ref_waiting.remove(seq)
        else:
            self.running.remove(seq)
            self.ref_running.remove(seq)
        self.queue.discard(seq)  # a second discard changes nothing
        seq.status = SequenceStatus.FINISHED_ABORTED

    def check_contents(self) -> None:
        assert len(self.queue) == len(self.ref_waiting) and bool(self.queue) == bool(self.ref_waiting)
        assert [s.seq_id for s in self.queue] == [s.seq_id for s in self.ref_waiting]
        assert [s.seq_id for s in self.running] == [s.seq_id for s in self.ref_running]
        assert all(s in self.queue and s not in self.running for s in self.ref_waiting)
        for tenant in self.tenants:
            assert self.running.count(tenant) == sum(s.tenant == tenant for s in self.ref_running)
        adapters_expected = {s.adapter_id for s in self.ref_waiting if s.adapter_id is not None}
        assert set(self.queue.adapters()) == adapters_expected


@pytest.mark.parametrize("slack", [0, lazy_heap.COMPACT_SLACK])  # 0: compaction, mid-admission too
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(10))
def test_random_events_match_the_references(policy, seed, slack, monkeypatch):
    monkeypatch.setattr(lazy_heap, "COMPACT_SLACK", slack)
    rng = random.Random(f"{policy}-{seed}")
    run = Run(policy, rng)
    events = [run.arrive] * 6 + [run.admit] * 3 + [run.preempt] * 2 + [run.finish] * 2 + [run.abort]
    for _ in range(400):
        rng.choice(events)()
        run.check_contents()
    while run.ref_waiting:  # drain: every order is checked to its end
        run.admit()
        run.finish()
    run.check_contents()


def test_adapters_are_indexed_in_list_order():
    queue = WaitingQueue("fair")
    seqs = [Sequence(seq_id=i, request_id="r", prompt_token_ids=[1], params=SamplingParams(), adapter_id=a,
                     arrival_time=t) for i, (a, t) in enumerate([("x", 2.0), (None, 1.0), ("y", 1.0), ("x", 1.0)])]
    for seq in seqs:
        queue.add(seq)
    assert set(queue.adapters()) == {"x", "y"}
    assert [s.seq_id for s in queue.with_adapters(["x", "y"])] == [2, 3, 0]  # arrival, then entry
    queue.discard(seqs[2])
    assert set(queue.adapters()) == {"x"} and [s.seq_id for s in queue.with_adapters(["y"])] == []


def test_adding_during_admission_is_refused_and_duplicates_are_refused():
    queue, running = WaitingQueue("fair"), RunningSet("fair")
    seqs = [Sequence(seq_id=i, request_id="r", prompt_token_ids=[1], params=SamplingParams(), tenant="a")
            for i in range(3)]
    queue.add(seqs[0])
    queue.add(seqs[1])
    with pytest.raises(ValueError):
        queue.add(seqs[0])
    order = queue.admission_order(running)
    next(order)
    queue.add(seqs[2])
    with pytest.raises(RuntimeError):
        next(order)
    running.add(seqs[0])
    with pytest.raises(ValueError):
        running.add(seqs[0])
    running.remove(seqs[0])
    with pytest.raises(ValueError):
        running.remove(seqs[0])
