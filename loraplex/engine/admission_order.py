"""In which order waiting sequences are offered admission, and which running sequence gives way
when KV memory runs out, under each scheduling policy. Pure Python, no torch.

- ``fcfs``: arrival order; the most recently admitted sequence is preempted first (vLLM's
  default).
- ``priority``: lower ``priority`` first, then arrival (vLLM's ``--scheduling-policy priority``);
  the victim is the sequence with the highest priority value, the latest admitted among equals.
- ``fair`` (loraplex's default): the tenant with the smallest weighted load (its running
  sequences divided by its weight) is offered the next admission, ties going to the tenant
  whose next request arrived first; within a tenant, lower ``priority`` first, then arrival.
  One tenant's burst of requests queues behind its own earlier ones, not in front of every
  other tenant's: a tenant with nothing running is offered the next admission. ``priority`` is
  the client's, so it only orders a tenant's own requests: a tenant sending everything at
  priority -1 must not starve the others (it would, were priority compared across tenants).
  The victim is a sequence of the tenant with the largest weighted load: its lowest priority,
  newest among equals. With queues on both sides, a tenant of weight 2 so holds about twice
  the running sequences of a tenant of weight 1.

A tenant's weight (the operator's ``scheduling_weight``, 1 by default) travels with each of its
sequences as ``tenant_weight``. Should an operator change it while sequences of both values are
in the engine, the tenant's weight is the one carried by its most recently arrived sequence
among those considered (waiting and running for admission, running for preemption).

Sequences without a tenant (offline use) form one group, so ``fair`` is ``priority`` for them.

The functions below work the order out from lists, from scratch (the statement of each policy,
and the LoRA starvation check's order over its few candidates); the scheduler's step uses
``WaitingQueue`` and ``RunningSet``, which keep the same order as sequences come and go.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from typing import Iterable, Iterator

from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.sampling_params import InvalidRequestError


def tenant_weights(seqs: Iterable[Sequence]) -> dict[str | None, float]:
    """Each tenant's weight: the one its most recently arrived sequence carries."""
    newest: dict[str | None, Sequence] = {}
    for seq in seqs:
        seen = newest.get(seq.tenant)
        if seen is None or (seq.arrival_time, seq.seq_id) > (seen.arrival_time, seen.seq_id):
            newest[seq.tenant] = seq
    return {tenant: seq.tenant_weight for tenant, seq in newest.items()}


def admission_order(waiting: Iterable[Sequence], running: Iterable[Sequence], policy: str) -> Iterator[Sequence]:
    """Yield the waiting sequences best first. Lazy: after each yield, a sequence the caller
    admitted (status RUNNING) counts toward its tenant's running load for the ones after it."""
    waiting = list(waiting)
    running = list(running)
    if policy == "fcfs":
        yield from waiting
        return
    by_tenant: dict[str | None, list[Sequence]] = {}
    for seq in waiting:  # arrival order, kept within each group by the stable sort below
        by_tenant.setdefault(seq.tenant if policy == "fair" else None, []).append(seq)
    load = Counter(s.tenant for s in running) if policy == "fair" else Counter()
    weight = tenant_weights(running + waiting) if policy == "fair" else {}
    tiebreak = itertools.count()
    heap = []
    queues = {}
    for tenant, seqs in by_tenant.items():
        seqs.sort(key=lambda s: s.priority)
        queues[tenant] = iter(seqs)
        heap.append(_entry(next(queues[tenant]), load[tenant] / weight.get(tenant, 1.0), tiebreak, tenant))
    heapq.heapify(heap)
    while heap:
        *_, seq, tenant = heapq.heappop(heap)
        yield seq
        if seq.status is SequenceStatus.RUNNING:
            load[tenant] += 1
        following = next(queues[tenant], None)
        if following is not None:
            heapq.heappush(heap, _entry(following, load[tenant] / weight.get(tenant, 1.0), tiebreak, tenant))


def _entry(head: Sequence, weighted_load: float, tiebreak, tenant):
    # across groups, priority plays no part: under "priority" there is one group, and under
    # "fair" it orders only a tenant's own queue (the sort above)
    return (weighted_load, head.arrival_time, next(tiebreak), head, tenant)


def preemption_victim(running: list[Sequence], policy: str) -> Sequence:
    """The running sequence to preempt when a running one needs a KV block and none is free.
    ``running`` is in admission order."""
    if policy == "fcfs":
        return running[-1]
    if policy == "priority":
        return max(enumerate(running), key=lambda item: (item[1].priority, item[0]))[1]
    load = Counter(s.tenant for s in running)
    weight = tenant_weights(running)
    return max(enumerate(running),
               key=lambda item: (load[item[1].tenant] / weight[item[1].tenant], item[1].priority, item[0]))[1]


PRIORITY_LIMIT = 1 << 31  # |priority| below this: an int any client library can send


def check_priority(priority, policy: str) -> None:
    """Refuse a priority that is not a bounded int, or a non-zero one the policy ignores
    (vLLM refuses those under ``fcfs`` too: a client relying on it would be misled)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidRequestError("priority must be an integer", param="priority")
    if not -PRIORITY_LIMIT < priority < PRIORITY_LIMIT:
        raise InvalidRequestError(f"priority must be between {-PRIORITY_LIMIT + 1} and {PRIORITY_LIMIT - 1}",
                                  param="priority")
    if priority != 0 and policy == "fcfs":
        raise InvalidRequestError(
            "priority is not used by the scheduling policy fcfs: choose fair or priority "
            "(`--scheduling-policy` for a server, `scheduling_policy=` for LLM), or send priority 0", param="priority")


def _finite(value: int | float) -> bool:
    """math.isfinite, and False for an int too large for a float (isfinite raises on those)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_tenant_weight(weight) -> None:
    """A tenant weight is a finite number above 0 (the registry bounds what operators set)."""
    # ``not weight > 0`` refuses NaN too; _finite refuses inf and an int no float holds (which
    # math.isfinite would raise OverflowError on, not a refusal naming the field)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0 or not _finite(weight):
        raise InvalidRequestError(f"tenant_weight must be a finite number above 0, not {weight!r}",
                                  param="tenant_weight")
