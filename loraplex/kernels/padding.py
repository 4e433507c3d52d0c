"""Grouping variable-size work into padded batches with a bound on the padding (CPU paths)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def padded_groups(items: Sequence[T], dims: Callable[[T], tuple[int, ...]], max_padding: float) -> list[list[T]]:
    """Cut ``items`` (taken in ascending ``dims`` order) into groups that each run as one padded
    call: a group's padded work, ``len(group) * prod(max of each dim)``, stays within
    ``max_padding`` times its real work, ``sum(prod(dims))``. Greedy: an item that would break
    the bound starts a new group, so one large item never pads a group of small ones."""
    groups: list[list[T]] = []
    real = 0
    for item in sorted(items, key=dims):
        work = math.prod(dims(item))
        if groups:
            group = groups[-1]
            widest = [max(d) for d in zip(*(dims(i) for i in group), dims(item))]
            if (len(group) + 1) * math.prod(widest) <= max_padding * (real + work):
                group.append(item)
                real += work
                continue
        groups.append([item])
        real = work
    return groups
