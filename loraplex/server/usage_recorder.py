"""Usage accounting on the serving side: finished requests summed in memory, written to the
registry in batches from a background thread.

``record`` is called once per finished request (``RequestRun.close``, on the event loop): it only
adds to an in-memory sum per (tenant, adapter, UTC hour), under a lock held for a dict update.
Every ``flush_seconds`` a daemon thread takes the sums and hands them to ``write``
(``RegistryService.record_usage``: additive upserts, one transaction), so the database sees one
batch per interval and replica, never a write per request, and never from the event loop.
``stop`` ends the thread and flushes what is left (the app's shutdown, after in-flight requests
have finished).

A failed write (database down) puts the batch back, added to what arrived meanwhile, for the
next flush; nothing is lost while the database comes back. Memory stays bounded: at most
``max_pending_rows`` (tenant, adapter, hour) sums are held; counts for a further row are dropped,
counted in ``dropped_requests`` and logged, rather than growing without end through a long outage.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from loraplex.registry.usage import COUNTERS, UsageDelta, hour_of

log = logging.getLogger("loraplex.server")

# enough for every adapter of a large deployment through an outage of many hours; one row is a
# tuple key and a six-int list, a few hundred bytes
DEFAULT_MAX_PENDING_ROWS = 100_000
Key = tuple[str, "str | None", object]  # (tenant, adapter or None for the base model, hour)


class UsageRecorder:
    """Sums finished requests per (tenant, adapter, hour) and writes them with ``write`` every
    ``flush_seconds`` from a daemon thread (``start``/``stop``), or when ``flush`` is called."""

    def __init__(
        self,
        write: Callable[[Sequence[UsageDelta]], None],
        flush_seconds: float,
        *,
        max_pending_rows: int = DEFAULT_MAX_PENDING_ROWS,
        clock: Callable[[], float] = time.time,
    ):
        if flush_seconds <= 0:
            raise ValueError("flush_seconds must be positive (0 means: do not create a recorder)")
        self._write = write
        self.flush_seconds = float(flush_seconds)
        self.max_pending_rows = int(max_pending_rows)
        self._clock = clock
        self._pending: dict[Key, list[int]] = {}
        self._lock = threading.Lock()  # guards _pending and dropped_requests
        self._flush_lock = threading.Lock()  # one flush at a time: the thread's, stop's, an admin read's
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.dropped_requests = 0
        self.flushes = 0
        self.failed_flushes = 0

    def record(self, tenant: str, adapter: str | None, *, prompt_tokens: int, completion_tokens: int,
               ok: bool) -> None:
        """Count one finished request: ``ok`` (answered, status 200) with the tokens its ``usage``
        reported, or failed after admission with the tokens it used until it ended."""
        counts = [1, prompt_tokens, completion_tokens, 0, 0, 0] if ok else [0, 0, 0, 1, prompt_tokens, completion_tokens]
        key = (tenant, adapter, hour_of(self._clock()))
        with self._lock:
            self._add(key, counts)

    def _add(self, key: Key, counts: list[int]) -> None:
        """Add ``counts`` to ``key``'s sum, or drop them when that would exceed the bound (lock held)."""
        row = self._pending.get(key)
        if row is None:
            if len(self._pending) >= self.max_pending_rows:
                if self.dropped_requests == 0:  # then once per failed flush, not once per request
                    log.error("usage accounting: %d rows wait to be written (the limit); usage of further "
                              "rows is dropped until a flush succeeds", len(self._pending))
                self.dropped_requests += counts[0] + counts[3]
                return
            self._pending[key] = row = [0] * len(COUNTERS)
        for i, value in enumerate(counts):
            row[i] += value

    @property
    def pending_rows(self) -> int:
        with self._lock:
            return len(self._pending)

    def stats(self) -> dict:
        """For ``GET /admin/v1/status``: a growing ``failed_flushes`` or any ``dropped_requests``
        says the database is not taking the usage."""
        with self._lock:
            pending, dropped = len(self._pending), self.dropped_requests
        return {"flush_seconds": self.flush_seconds, "pending_rows": pending, "flushes": self.flushes,
                "failed_flushes": self.failed_flushes, "dropped_requests": dropped}

    def flush(self) -> bool:
        """Write what has been summed; True when it was written (or there was nothing). On
        failure the sums go back for the next flush and the error is logged, never raised."""
        with self._flush_lock:
            with self._lock:
                batch, self._pending = self._pending, {}
            if not batch:
                return True
            deltas = [UsageDelta(tenant, adapter, hour, **dict(zip(COUNTERS, counts)))
                      for (tenant, adapter, hour), counts in batch.items()]
            try:
                self._write(deltas)
            except Exception:  # noqa: BLE001 - kept for the next flush; serving goes on
                self.failed_flushes += 1
                with self._lock:
                    for key, counts in batch.items():
                        self._add(key, counts)
                log.exception("usage accounting: writing %d row(s) failed; kept for the next flush "
                              "(%d request(s) dropped so far)", len(batch), self.dropped_requests)
                return False
            self.flushes += 1
            return True

    def _run(self) -> None:
        while not self._stop.wait(self.flush_seconds):
            self.flush()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> UsageRecorder:
        if self._thread is not None:
            raise RuntimeError("usage recorder already started")
        self._thread = threading.Thread(target=self._run, name="usage-flush", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> bool:
        """End the thread, then flush what is left; True when nothing is left unwritten."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        ok = self.flush()
        if not ok:
            log.error("usage accounting: %d row(s) could not be written at shutdown and are lost", self.pending_rows)
        return ok
