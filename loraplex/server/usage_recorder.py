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
  meanwhile, bounded: at most ``max_pending_rows`` distinct (tenant, adapter, hour) keys are
  held (usage of a held key always adds up).
* Permanent (the database refused a value): sending it again cannot succeed, and would hold up
  every later batch. A batch of several rows is split into one batch per row (ids derived from
  the batch's, so a split replayed from the spool splits the same way), so the rows the
  database takes are kept; a row it refuses is logged with its counts (for a manual
  correction), counted in ``dropped_records`` (``loraplex_usage_records_dropped_total``) and
  dropped.

Writing a taken batch, splitting or dropping what the database refuses, spooling and replaying
are ``usage_outbox.UsageOutbox``'s; this module sums, holds (the bound) and decides when.

With a ``spool`` (``usage_spool.UsageSpool``, the app's ``<home>/usage-spool``), usage the
recorder cannot hold is written to disk instead of lost: what is left unwritten at ``stop``,
and, when the bound is reached during an outage, the held batches (further keys are summed
apart, at most ``max_pending_rows`` of them, and the thread is woken to spool both). Each flush
that wrote everything in memory then replays the spool (the thread's first flush runs at
``start``), deleting a file once its batch is committed. Without a spool, or when the spool
cannot be written, usage of a further key is dropped, counted in ``dropped_requests`` and
logged; what is left at ``stop`` is logged as lost.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence

from loraplex.registry.usage import COUNTERS, UsageDelta, hour_of, is_permanent_usage_error
from loraplex.server.usage_outbox import FAILED, REFUSED, Batch, Key, UsageOutbox
from loraplex.server.usage_spool import UsageSpool

log = logging.getLogger("loraplex.server")

# enough for every adapter of a large deployment through an outage of many hours; one row is a
# tuple key and a six-int list, a few hundred bytes
DEFAULT_MAX_PENDING_ROWS = 100_000
# the thread's wait after n failed flushes in a row: flush_seconds * 2**n, at most this (or
# flush_seconds when that is longer)
DEFAULT_MAX_BACKOFF_S = 60.0


class UsageRecorder:
    """Sums finished requests per (tenant, adapter, hour) and writes them with
    ``write(deltas, batch_id)`` every ``flush_seconds`` from a daemon thread (``start``/``stop``),
    or when ``flush`` is called; usage it cannot write or hold goes to ``spool`` when given."""

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
        spool: UsageSpool | None = None,
    ):
        if flush_seconds <= 0:
            raise ValueError("flush_seconds must be positive (0 means: do not create a recorder)")
        self.flush_seconds = float(flush_seconds)
        self.max_pending_rows = int(max_pending_rows)
        self.max_backoff_seconds = max(float(max_backoff_seconds), self.flush_seconds)
        self._clock = clock
        self._new_batch_id = new_batch_id
        self.spool = spool
        self._outbox = UsageOutbox(write, is_permanent, spool, requests_dropped=lambda: self.dropped_requests)
        self._pending: dict[Key, list[int]] = {}  # summed since the last batch was taken
        # taken, not yet known written; resent as they are. Changed only under _flush_lock
        # (appended to under _lock as well), so a batch being written stays where it is
        self._unsent: deque[Batch] = deque()
        self._unsent_keys: set[Key] = set()
        self._overlap = 0  # keys both pending and in an unsent batch (counted once for the bound)
        self._overflow: dict[Key, list[int]] = {}  # summed past the bound, for the thread to spool
        self._lock = threading.Lock()  # guards the above and dropped_requests
        self._flush_lock = threading.Lock()  # one flush at a time: the thread's, stop's, an admin read's
        self._stop = threading.Event()
        self._wake = threading.Event()  # the thread's wait: its interval, the bound reached, stop
        self._thread: threading.Thread | None = None
        self.dropped_requests = 0

    def record(self, tenant: str, adapter: str | None, *, prompt_tokens: int, completion_tokens: int,
               ok: bool) -> None:
        """Count one finished request: ``ok`` (answered, status 200) with the tokens its ``usage``
        reported, or failed after admission with the tokens it used until it ended."""
        counts = [1, prompt_tokens, completion_tokens, 0, 0, 0] if ok else [0, 0, 0, 1, prompt_tokens, completion_tokens]
        key = (tenant, adapter, hour_of(self._clock()))
        with self._lock:
            self._add(key, counts)

    def _add(self, key: Key, counts: list[int]) -> None:
        """Add ``counts`` to ``key``'s sum; past the bound, to the sums the thread is woken to
        spool, or nowhere (dropped) without a spool or room there (lock held)."""
        row = self._pending.get(key)
        if row is None:
            held = key in self._unsent_keys
            if held or self._held_keys() < self.max_pending_rows:
                self._pending[key] = row = [0] * len(COUNTERS)
                self._overlap += held
            else:
                row = self._overflow_row(key)
                if row is None:
                    if self.dropped_requests == 0:  # then once per failed flush, not once per request
                        log.error("usage accounting: %d rows wait to be written (the limit)%s; usage of further "
                                  "rows is dropped until a flush succeeds", self._held_keys(),
                                  "" if self.spool is None else " and as many to be spooled")
                    self.dropped_requests += counts[0] + counts[3]
                    return
        for i, value in enumerate(counts):
            row[i] += value

    def _overflow_row(self, key: Key) -> list[int] | None:
        """``key``'s sum past the bound, for the thread to spool (woken now); None without a
        spool, or when as many rows wait for it as the bound (lock held)."""
        if self.spool is None:
            return None
        self._wake.set()
        row = self._overflow.get(key)
        if row is None and len(self._overflow) < self.max_pending_rows:
            self._overflow[key] = row = [0] * len(COUNTERS)
        return row

    def _held_keys(self) -> int:
        """Distinct keys held, pending or unsent (lock held)."""
        return len(self._pending) + len(self._unsent_keys) - self._overlap

    @property
    def flushes(self) -> int:
        """Batches written."""
        return self._outbox.flushes

    @property
    def failed_flushes(self) -> int:
        return self._outbox.failed_flushes

    @property
    def dropped_records(self) -> int:
        """Rows the database refused, logged and dropped."""
        return self._outbox.dropped_records

    @property
    def spool_files_set_aside(self) -> int:
        return self._outbox.spool_files_set_aside

    @property
    def pending_rows(self) -> int:
        """Rows (tenant, adapter, hour) not yet written, nor spooled."""
        with self._lock:
            return self._held_keys() + len(self._overflow)

    def stats(self) -> dict:
        """For ``GET /admin/v1/status``: a growing ``failed_flushes``, or any ``dropped_requests``
        or ``dropped_records``, says the database is not taking the usage; ``spooled_batches``
        waits on disk to be replayed; ``spool_files_set_aside`` could not be read (``*.bad``)."""
        with self._lock:
            pending, dropped = self._held_keys() + len(self._overflow), self.dropped_requests
        return {"flush_seconds": self.flush_seconds, "pending_rows": pending, "flushes": self.flushes,
                "failed_flushes": self.failed_flushes, "dropped_requests": dropped,
                "dropped_records": self.dropped_records,
                "spool_dir": None if self.spool is None else str(self.spool.directory),
                "spooled_batches": 0 if self.spool is None else self.spool.count(),
                "spool_files_set_aside": self.spool_files_set_aside}

    def flush(self) -> bool:
        """Write the unsent batches, then what has been summed, then replay the spool; True when
        all was written (or there was nothing). A transient failure keeps the batch for the next
        flush and returns False; a refused row is dropped (see the module doc). At the bound,
        the held batches are spooled first. Logs, never raises."""
        with self._flush_lock:
            if self._overflow:
                self._spool_held(with_pending=False)
            return self._write_held() and self._outbox.replay()

    def _write_held(self) -> bool:
        took_pending = False
        while True:
            with self._lock:
                if not self._unsent:
                    if took_pending or not self._pending:
                        self._outbox.all_written()
                        return True
                    self._take_pending()
                    took_pending = True
                batch = self._unsent[0]
            result = self._outbox.send(batch, "kept for the next flush")
            if result == FAILED:
                return False
            with self._lock:
                self._unsent.popleft()
                if result == REFUSED:
                    self._unsent.extendleft(reversed(self._outbox.split_or_drop(batch)))
                self._unsent_keys = {key for b in self._unsent for key in b.rows}
                self._overlap = sum(1 for key in self._pending if key in self._unsent_keys)

    def _take_pending(self) -> None:
        """The pending sums become an unsent batch with a new id (lock held)."""
        batch = Batch(self._new_batch_id(), {key: tuple(counts) for key, counts in self._pending.items()})
        self._pending = {}
        self._overlap = 0
        self._unsent.append(batch)
        self._unsent_keys.update(batch.rows)

    def _spool_held(self, *, with_pending: bool) -> int:
        """Move the unsent batches and the sums past the bound (and with ``with_pending``, the
        pending sums) to the spool; those it cannot write stay unsent. Returns the rows spooled
        (flush lock held)."""
        with self._lock:
            if with_pending and self._pending:
                self._take_pending()
            batches = list(self._unsent)
            if self._overflow:
                batches.append(Batch(self._new_batch_id(), {k: tuple(c) for k, c in self._overflow.items()}))
            self._unsent, self._unsent_keys, self._overlap, self._overflow = deque(), set(), 0, {}
        kept, spooled = self._outbox.save(batches)
        with self._lock:
            self._unsent.extendleft(reversed(kept))
            self._unsent_keys = {key for b in self._unsent for key in b.rows}
            self._overlap = sum(1 for key in self._pending if key in self._unsent_keys)
        return spooled

    def next_wait(self) -> float:
        """The thread's wait before its next flush: ``flush_seconds``, doubled after each failed
        flush in a row, at most ``max_backoff_seconds``."""
        return min(self.flush_seconds * 2 ** min(self._outbox.failures_in_a_row, 30), self.max_backoff_seconds)

    def _run(self) -> None:
        self.flush()  # at once: replays what an earlier process spooled
        while not self._stop.is_set():
            self._wake.wait(self.next_wait())
            self._wake.clear()
            if self._stop.is_set():
                return
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
        """End the thread, then flush what is left; True when all of it was written. What the
        database did not take goes to the spool (logged), or is logged as lost without one."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.flush():
            return True
        if self.spool is not None:
            with self._flush_lock:
                spooled = self._spool_held(with_pending=True)
            if spooled:
                log.error("usage accounting: the database did not take %d row(s) at shutdown; spooled to %s, "
                          "replayed at the next start", spooled, self.spool.directory)
        if self.pending_rows:
            log.error("usage accounting: %d row(s) could not be written at shutdown and are lost", self.pending_rows)
        return False
