"""A small cache of registry answers for the request path: each entry lives ``ttl_seconds``,
is filled by a blocking lookup run off the event loop, and can be dropped at once when this
replica changes what it caches (``forget`` / ``forget_all``).

``auth.TenantAuth`` (key -> tenant) and ``tenant_limits.TenantLimitsCache`` (tenant -> limits)
share it, so the one subtle rule lives here once: a lookup that began before a ``forget`` may
have read the old row, and caching its late answer would undo the forget for a whole TTL.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from starlette.concurrency import run_in_threadpool

V = TypeVar("V")

MAX_ENTRIES = 10_000  # past this the cache starts over, bounding its memory


class ExpiringCache(Generic[V]):
    """Thread-safe ``key -> value`` entries that expire ``ttl_seconds`` after they were loaded.
    ``None`` answers are never cached (an unknown key is looked up again on its next use)."""

    def __init__(self, ttl_seconds: float, max_entries: int = MAX_ENTRIES):
        self.ttl_seconds = ttl_seconds
        self.max_entries = max_entries
        self._entries: dict[str, tuple[V, float]] = {}  # key -> (value, expires at, monotonic)
        self._lock = threading.Lock()
        # bumped by every forget: an answer loaded across one is returned but not cached
        self._generation = 0

    async def get_or_load(self, key: str, load: Callable[[], V | None]) -> V | None:
        """The live entry for ``key``, else ``load()`` (a blocking registry read, run in the
        thread pool) cached for ``ttl_seconds`` unless it is ``None``."""
        now = time.monotonic()
        with self._lock:
            hit = self._entries.get(key)
            generation = self._generation
        if hit is not None and hit[1] > now:
            return hit[0]
        value = await run_in_threadpool(load)
        if value is None:
            return None
        with self._lock:
            if generation == self._generation:
                if len(self._entries) >= self.max_entries:
                    self._entries.clear()
                self._entries[key] = (value, now + self.ttl_seconds)
        return value

    def forget(self, key: str) -> None:
        """Drop one entry: its next use loads it again."""
        with self._lock:
            self._entries.pop(key, None)
            self._generation += 1

    def forget_all(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._entries.clear()
            self._generation += 1

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
