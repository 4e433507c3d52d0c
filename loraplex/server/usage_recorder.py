"""Usage accounting on the serving side: finished requests summed in memory, written to the
registry in batches from a background thread.

``record`` is called once per finished request (``RequestRun.close``, on the event loop): it only
adds to an in-memory sum per (tenant, adapter, UTC hour), under a lock held for a dict update.
Every ``flush_seconds`` a daemon thread takes the sums as a batch with a fresh id and hands it
to ``write`` (``RegistryService.record_usage``: additive upserts and the batch id, one
transaction), so the database sees one batch per interval and replica, never a write per
request, and never from the event loop. ``stop`` ends the thread and flushes what is left (the
app's shutdown, after in-flight requests have finished).

Failures are of two kinds (``is_permanent``, default ``usage.is_permanent_usage_error``):

* Transient (database down, connection dropped, lock lost): the batch is kept as it is, id and
  all, and sent again at later flushes, the thread waiting longer after each failure (up to
  ``max_backoff_seconds``). A batch whose commit went through but whose acknowledgement was lost
  is then recognised by its id and adds nothing: it is never merged with newer usage, which
  would make it a batch the database has not seen. Newer usage keeps adding up in memory
  meanwhile. Memory stays bounded: at most ``max_pending_rows`` distinct (tenant, adapter, hour)
  keys are held (usage of a held key always adds up); counts for a further key are dropped,
  counted in ``dropped_requests`` and logged, rather than growing without end through an outage.
* Permanent (the database refused a value): sending it again cannot succeed, and would hold up
  every later batch. A batch of several rows is split into one batch per row, so the rows the
  database takes are kept; a row it refuses is logged with its counts (for a manual correction),
  counted in ``dropped_records`` (``loraplex_usage_records_dropped_total``) and dropped.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loraplex.registry.usage import COUNTERS, UsageDelta, hour_of, is_permanent_usage_error

log = logging.getLogger("loraplex.server")

# enough for every adapter of a large deployment through an outage of many hours; one row is a
# tuple key and a six-int list, a few hundred bytes
DEFAULT_MAX_PENDING_ROWS = 100_000
# the thread's wait after n failed flushes in a row: flush_seconds * 2**n, at most this (or
# flush_seconds when that is longer)
DEFAULT_MAX_BACKOFF_S = 60.0
Key = tuple[str, "str | None", object]  # (tenant, adapter or None for the base model, hour)


@dataclass(frozen=True)
class Batch:
    """Sums sent to the database under one id; resent unchanged until it is known written."""

    id: str
    rows: dict[Key, tuple[int, ...]]

    def deltas(self) -> list[UsageDelta]:
        return [UsageDelta(tenant, adapter, hour, **dict(zip(COUNTERS, counts)))
                for (tenant, adapter, hour), counts in self.rows.items()]


class UsageRecorder:
    """Sums finished requests per (tenant, adapter, hour) and writes them with
    ``write(deltas, batch_id)`` every ``flush_seconds`` from a daemon thread (``start``/``stop``),
    or when ``flush`` is called."""

    def __init__(
        self,
        write: Callable[[Sequence[UsageDelta], str], object],
        flush_seconds: float,
        *,
        max_pending_rows: int = DEFAULT_MAX_PENDING_ROWS,
        clock: Callable[[], float] = time.time,
        is_permanent: Callable[[BaseException], bool] = is_permanent_usage_error,
        max_backoff_seconds: float = DEFAULT_MAX_BACKOFF_S,
        new_batch_id: Callable[[], str] = lambda: uuid.uuid4().hex,
    ):
        if flush_seconds <= 0:
            raise ValueError("flush_seconds must be positive (0 means: do not create a recorder)")
        self._write = write
        self.flush_seconds = float(flush_seconds)
        self.max_pending_rows = int(max_pending_rows)
        self.max_backoff_seconds = max(float(max_backoff_seconds), self.flush_seconds)
        self._clock = clock
        self._is_permanent = is_permanent
        self._new_batch_id = new_batch_id
        self._pending: dict[Key, list[int]] = {}  # summed since the last batch was taken
        self._unsent: deque[Batch] = deque()  # taken, not yet known written; resent as they are
        self._unsent_keys: set[Key] = set()
        self._overlap = 0  # keys both pending and in an unsent batch (counted once for the bound)
        self._lock = threading.Lock()  # guards the four above and dropped_requests
        self._flush_lock = threading.Lock()  # one flush at a time: the thread's, stop's, an admin read's
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.dropped_requests = 0
        self.dropped_records = 0
        self.flushes = 0
        self.failed_flushes = 0
        self._failures_in_a_row = 0

    def record(self, tenant: str, adapter: str | None, *, prompt_tokens: int, completion_tokens: int,
               ok: bool) -> None:
        """Count one finished request: ``ok`` (answered, status 200) with the tokens its ``usage``
        reported, or failed after admission with the tokens it used until it ended."""
        counts = [1, prompt_tokens, completion_tokens, 0, 0, 0] if ok else [0, 0, 0, 1, prompt_tokens, completion_tokens]
        key = (tenant, adapter, hour_of(self._clock()))
        with self._lock:
            self._add(key, counts)

    def _add(self, key: Key, counts: list[int]) -> None:
        """Add ``counts`` to ``key``'s sum, or drop them when a new key would exceed the bound (lock held)."""
        row = self._pending.get(key)
        if row is None:
            held = key in self._unsent_keys
            if not held and self._held_keys() >= self.max_pending_rows:
                if self.dropped_requests == 0:  # then once per failed flush, not once per request
                    log.error("usage accounting: %d rows wait to be written (the limit); usage of further "
                              "rows is dropped until a flush succeeds", self._held_keys())
                self.dropped_requests += counts[0] + counts[3]
                return
            self._pending[key] = row = [0] * len(COUNTERS)
            self._overlap += held
        for i, value in enumerate(counts):
            row[i] += value

    def _held_keys(self) -> int:
        """Distinct keys held, pending or unsent (lock held)."""
        return len(self._pending) + len(self._unsent_keys) - self._overlap

    @property
    def pending_rows(self) -> int:
        """Distinct (tenant, adapter, hour) keys not yet written."""
        with self._lock:
            return self._held_keys()

    def stats(self) -> dict:
        """For ``GET /admin/v1/status``: a growing ``failed_flushes``, or any ``dropped_requests``
        or ``dropped_records``, says the database is not taking the usage."""
        with self._lock:
            pending, dropped = self._held_keys(), self.dropped_requests
        return {"flush_seconds": self.flush_seconds, "pending_rows": pending, "flushes": self.flushes,
                "failed_flushes": self.failed_flushes, "dropped_requests": dropped,
                "dropped_records": self.dropped_records}

    def flush(self) -> bool:
        """Write the unsent batches, then what has been summed; True when all was written (or
        there was nothing). A transient failure keeps the batch for the next flush and returns
        False; a refused row is dropped (see the module doc). Logs, never raises."""
        with self._flush_lock:
            took_pending = False
            while True:
                with self._lock:
                    if not self._unsent:
                        if took_pending or not self._pending:
                            self._failures_in_a_row = 0
                            return True
                        self._take_pending()
                        took_pending = True
                    batch = self._unsent[0]
                try:
                    self._write(batch.deltas(), batch.id)
                except Exception as exc:  # noqa: BLE001 - sorted below; serving goes on
                    if not self._is_permanent(exc):
                        self.failed_flushes += 1
                        self._failures_in_a_row += 1
                        log.exception("usage accounting: writing %d row(s) failed; kept for the next flush "
                                      "(%d request(s) dropped so far)", len(batch.rows), self.dropped_requests)
                        return False
                    self._refused(batch, exc)
                    continue
                self.flushes += 1
                self._done(batch)

    def _take_pending(self) -> None:
        """The pending sums become an unsent batch with a new id (lock held)."""
        batch = Batch(self._new_batch_id(), {key: tuple(counts) for key, counts in self._pending.items()})
        self._pending = {}
        self._overlap = 0
        self._unsent.append(batch)
        self._unsent_keys.update(batch.rows)

    def _done(self, batch: Batch) -> None:
        with self._lock:
            self._unsent.popleft()
            self._unsent_keys = {key for b in self._unsent for key in b.rows}
            self._overlap = sum(1 for key in self._pending if key in self._unsent_keys)

    def _refused(self, batch: Batch, exc: Exception) -> None:
        """The database refused ``batch`` (nothing of it was written): split it into one batch
        per row, or drop it when it is one row."""
        if len(batch.rows) > 1:
            log.warning("usage accounting: the database refused a batch of %d rows (%s); writing them "
                        "one by one to keep the good ones", len(batch.rows), exc)
            singles = [Batch(self._new_batch_id(), {key: counts}) for key, counts in batch.rows.items()]
            with self._lock:
                self._unsent.popleft()
                self._unsent.extendleft(reversed(singles))
            return
        (tenant, adapter, hour), counts = next(iter(batch.rows.items()))
        log.error("usage accounting: DROPPED usage the database refused (%s): tenant=%r adapter=%r hour=%s %s",
                  exc, tenant, adapter, hour.isoformat(),
                  " ".join(f"{name}={value}" for name, value in zip(COUNTERS, counts)))
        self.dropped_records += 1
        self._done(batch)

    def next_wait(self) -> float:
        """The thread's wait before its next flush: ``flush_seconds``, doubled after each failed
        flush in a row, at most ``max_backoff_seconds``."""
        return min(self.flush_seconds * 2 ** min(self._failures_in_a_row, 30), self.max_backoff_seconds)

    def _run(self) -> None:
        while not self._stop.wait(self.next_wait()):
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
