"""Binary heaps of sequences with deferred removal, for the waiting queue and the running set.

An entry is a tuple ``(*key, token, seq)``. ``token`` is unique for the heap's owner, so tuple
comparison never reaches the sequence, and the entry is live while ``token`` is in the owner's
``live`` mapping. Removing a sequence only drops its token from ``live``: its entries leave a
heap when they reach the top, or when the owner swaps in a ``compacted`` copy once stale
entries outnumber live ones, so a removal costs O(1) amortized. Pure Python, no torch.
"""

from __future__ import annotations

import heapq
from typing import Container, Iterator

COMPACT_SLACK = 32  # stale entries tolerated beyond the live ones before a heap is rebuilt


def top(heap: list[tuple], live: Container[int]) -> tuple | None:
    """The smallest live entry, popping the stale ones above it (changes ``heap`` in place)."""
    while heap and heap[0][-2] not in live:
        heapq.heappop(heap)
    return heap[0] if heap else None


def in_order(heap: list[tuple], live: Container[int], after_top: bool = False) -> Iterator:
    """Yield the live entries' sequences smallest key first, lazily and without changing
    ``heap``: the k first cost O(k log k) (a frontier of the heap's nodes), not a sort of all.
    ``after_top``: start after ``heap[0]``. ``heap`` must not change while this runs; replacing
    the owner's list by a compacted copy is fine."""
    if not heap:
        return
    size = len(heap)
    frontier = [(heap[child], child) for child in (1, 2) if child < size] if after_top else [(heap[0], 0)]
    heapq.heapify(frontier)
    while frontier:
        entry, i = heapq.heappop(frontier)
        if entry[-2] in live:
            yield entry[-1]
        for child in (2 * i + 1, 2 * i + 2):
            if child < size:
                heapq.heappush(frontier, (heap[child], child))


def needs_compaction(heap: list[tuple], num_live: int) -> bool:
    return len(heap) > 2 * num_live + COMPACT_SLACK


def compacted(heap: list[tuple], live: Container[int]) -> list[tuple]:
    """A new heap of the live entries (the old list is left as it is, for running traversals)."""
    fresh = [entry for entry in heap if entry[-2] in live]
    heapq.heapify(fresh)
    return fresh
