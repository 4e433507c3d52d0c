"""Host-memory tier: validated adapters (``AdapterWeights``) under a byte budget, LRU.

Entries pinned here, or reported protected by the caller (an adapter with waiting requests that
has no device slot yet), are never evicted. An insertion that cannot make room by evicting
evicts nothing and is refused (the caller retries later); the one exception is an adapter
larger than the whole budget arriving at an empty cache, which is stored alone.

A read in flight (``HostLoader``) holds a reservation: its bytes are made free when the read
starts and count against the budget until its weights are ``put``, so nothing that lands or is
stored meanwhile can take them and the read is never wasted.
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
        self.used_bytes = 0  # of stored entries
        self._reserved: dict[str, int] = {}  # adapter id -> bytes held for its read in flight

    @property
    def reserved_bytes(self) -> int:
        return sum(self._reserved.values())

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
        if evictable == self.used_bytes and not self._reserved:  # the oversized-alone rule applies
            return True
        return self.used_bytes + self.reserved_bytes - evictable + nbytes <= self.budget_bytes

    def could_fit(self, nbytes: int) -> bool:
        """Whether ``nbytes`` fit once everything not pinned here is gone (entries in use are
        released in time; pinned ones only by an operator)."""
        pinned = sum(w.nbytes for a, w in self._entries.items() if a in self.pinned)
        return pinned == 0 or pinned + nbytes <= self.budget_bytes

    def put(self, weights: AdapterWeights, is_protected: Callable[[str], bool] = lambda _: False) -> tuple[bool, list[str]]:
        """Store ``weights`` (into its reservation, if it has one); returns (stored, ids evicted
        to make room)."""
        aid = weights.adapter_id
        self._reserved.pop(aid, None)
        if aid in self._entries:
            self._entries.move_to_end(aid)
            return True, []
        victims = self._make_room(weights.nbytes, is_protected)
        if victims is None:
            return False, []
        self._entries[aid] = weights
        self.used_bytes += weights.nbytes
        return True, victims

    def reserve(self, adapter_id: str, nbytes: int, is_protected: Callable[[str], bool] = lambda _: False
                ) -> tuple[bool, list[str]]:
        """Hold ``nbytes`` for a read of ``adapter_id`` that will ``put`` it; returns (reserved,
        ids evicted to make room)."""
        if adapter_id in self._reserved or adapter_id in self._entries:
            return True, []
        victims = self._make_room(nbytes, is_protected)
        if victims is None:
            return False, []
        self._reserved[adapter_id] = nbytes
        return True, victims

    def cancel(self, adapter_id: str) -> None:
        """Give back a reservation whose read will not be stored (failed, or dropped)."""
        self._reserved.pop(adapter_id, None)

    def _make_room(self, nbytes: int, is_protected: Callable[[str], bool]) -> list[str] | None:
        """Evict LRU entries (never pinned or protected ones) until ``nbytes`` fit; the ids
        evicted, or None (and nothing evicted) when they cannot fit."""
        need = self.used_bytes + self.reserved_bytes + nbytes - self.budget_bytes
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
            if freed < need and not (len(victims) == len(self._entries) and not self._reserved):
                return None
        for other in victims:
            self.remove(other)
        return victims

    def remove(self, adapter_id: str) -> bool:
        w = self._entries.pop(adapter_id, None)
        if w is None:
            return False
        self.used_bytes -= w.nbytes
        self.pinned.discard(adapter_id)
        return True
