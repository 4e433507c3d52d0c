"""Host-memory tier: validated adapters (``AdapterWeights``) under a byte budget, LRU.

Entries pinned here, or reported protected by the caller (an adapter with waiting requests that
has no device slot yet), are never evicted. An insertion that cannot make room by evicting
evicts nothing and is refused (the caller retries later); the one exception is an adapter
larger than the whole budget arriving at an empty cache, which is stored alone.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from loraplex.lora.weights import AdapterWeights


class HostCache:
    """LRU of ``AdapterWeights`` keyed by content hash, bounded by ``budget_bytes``."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._entries: "OrderedDict[str, AdapterWeights]" = OrderedDict()  # oldest first
        self.pinned: set[str] = set()
        self.used_bytes = 0

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def ids(self) -> list[str]:
        return list(self._entries)

    def get(self, adapter_id: str) -> AdapterWeights | None:
        w = self._entries.get(adapter_id)
        if w is not None:
            self._entries.move_to_end(adapter_id)
        return w

    def can_fit(self, nbytes: int, is_protected: Callable[[str], bool] = lambda _: False) -> bool:
        """Whether ``put`` of an adapter of ``nbytes`` would succeed now."""
        evictable = sum(w.nbytes for a, w in self._entries.items() if a not in self.pinned and not is_protected(a))
        if evictable == self.used_bytes:  # everything could go: the oversized-alone rule applies
            return True
        return self.used_bytes - evictable + nbytes <= self.budget_bytes

    def put(self, weights: AdapterWeights, is_protected: Callable[[str], bool] = lambda _: False) -> tuple[bool, list[str]]:
        """Store ``weights``; returns (stored, ids evicted to make room)."""
        aid = weights.adapter_id
        if aid in self._entries:
            self._entries.move_to_end(aid)
            return True, []
        need = self.used_bytes + weights.nbytes - self.budget_bytes
        victims: list[str] = []
        if need > 0:
            freed = 0
            for other, w in self._entries.items():
                if freed >= need:
                    break
                if other in self.pinned or is_protected(other):
                    continue
                victims.append(other)
                freed += w.nbytes
            if freed < need and not (len(victims) == len(self._entries)):
                return False, []
        for other in victims:
            self.remove(other)
        self._entries[aid] = weights
        self.used_bytes += weights.nbytes
        return True, victims

    def remove(self, adapter_id: str) -> bool:
        w = self._entries.pop(adapter_id, None)
        if w is None:
            return False
        self.used_bytes -= w.nbytes
        self.pinned.discard(adapter_id)
        return True
