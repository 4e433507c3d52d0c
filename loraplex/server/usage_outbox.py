"""Where a usage batch goes once the recorder (``usage_recorder.UsageRecorder``) has taken it from
its sums: to the database under its id, split row by row when the database refuses it, or to
the spool (``usage_spool.UsageSpool``) when the recorder must let go of it, replayed from there
once the database takes batches again.

* ``send``: one write (``RegistryService.record_usage``: additive upserts and the batch id, one
  transaction). A transient failure is logged and counted; the caller keeps the batch, id and
  all, and sends it again later (a batch whose commit went through but whose acknowledgement
  was lost is recognised by its id and adds nothing).
* ``split_or_drop``: a batch the database refused (``is_permanent``) becomes one batch per row,
  with ids derived from the batch's, so that a split replayed from the spool splits the same
  way; a single row it refuses is logged with its counts (for a manual correction), counted in
  ``dropped_records`` and dropped.
* ``save``: batches to the spool, one file each; those it cannot write are handed back.
* ``replay``: the spooled batches written under their ids, each file deleted once its batch is
  committed; an unreadable file is set aside (``*.bad``) and counted.

Only one thread uses an outbox at a time (the recorder's flush lock).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from hashlib import sha256

from loraplex.registry.usage import BATCH_ID_MAX_LENGTH, COUNTERS, UsageDelta
from loraplex.server.usage_spool import SpoolFileError, UsageSpool

log = logging.getLogger("loraplex.server")

Key = tuple[str, "str | None", object]  # (tenant, adapter or None for the base model, hour)
WRITTEN, FAILED, REFUSED = "written", "failed", "refused"


@dataclass(frozen=True)
class Batch:
    """Sums sent to the database under one id; resent unchanged until it is known written."""

    id: str
    rows: dict[Key, tuple[int, ...]]

    def deltas(self) -> list[UsageDelta]:
        return [UsageDelta(tenant, adapter, hour, **dict(zip(COUNTERS, counts)))
                for (tenant, adapter, hour), counts in self.rows.items()]

    def split(self) -> list[Batch]:
        """One batch per row, each id derived from this one's (the same split every time)."""
        return [Batch(_row_batch_id(self.id, i), {key: counts}) for i, (key, counts) in enumerate(self.rows.items())]


def _row_batch_id(batch_id: str, index: int) -> str:
    derived = f"{batch_id}.{index}"
    return derived if len(derived) <= BATCH_ID_MAX_LENGTH else sha256(derived.encode()).hexdigest()[:32]


class UsageOutbox:
    """Sends taken usage batches with ``write(deltas, batch_id)``, splits or drops what the
    database refuses, spools batches to ``spool`` (when given) and replays it; counts each."""

    def __init__(self, write: Callable[[Sequence[UsageDelta], str], object],
                 is_permanent: Callable[[BaseException], bool], spool: UsageSpool | None,
                 requests_dropped: Callable[[], int] = lambda: 0):
        """``requests_dropped()``: the recorder's count of requests it could not hold, for the
        log line of a failed write."""
        self._write = write
        self._is_permanent = is_permanent
        self.spool = spool
        self._requests_dropped = requests_dropped
        self.flushes = 0  # batches written
        self.failed_flushes = 0
        self.failures_in_a_row = 0  # transient failures since everything was last written
        self.dropped_records = 0
        self.spool_files_set_aside = 0

    def send(self, batch: Batch, if_failed: str) -> str:
        """Write ``batch``: WRITTEN (or recorded before), FAILED (transient, logged, saying
        ``if_failed``) or REFUSED (permanent: ``split_or_drop`` it)."""
        try:
            self._write(batch.deltas(), batch.id)
        except Exception as exc:  # noqa: BLE001 - sorted here; serving goes on
            if self._is_permanent(exc):
                return REFUSED
            self.failed_flushes += 1
            self.failures_in_a_row += 1
            log.exception("usage accounting: writing %d row(s) failed; %s (%d request(s) dropped so far)",
                          len(batch.rows), if_failed, self._requests_dropped())
            return FAILED
        self.flushes += 1
        return WRITTEN

    def all_written(self) -> None:
        """Everything held was written: the next transient failure is the first in a row."""
        self.failures_in_a_row = 0

    def split_or_drop(self, batch: Batch) -> list[Batch]:
        """The database refused ``batch`` (nothing of it was written): its rows as batches of
        one, or nothing when it is one row (logged with its counts and dropped)."""
        if len(batch.rows) > 1:
            log.warning("usage accounting: the database refused a batch of %d rows; writing them "
                        "one by one to keep the good ones", len(batch.rows))
            return batch.split()
        (tenant, adapter, hour), counts = next(iter(batch.rows.items()))
        log.error("usage accounting: DROPPED usage the database refused: tenant=%r adapter=%r hour=%s %s",
                  tenant, adapter, hour.isoformat(), " ".join(f"{n}={v}" for n, v in zip(COUNTERS, counts)))
        self.dropped_records += 1
        return []

    def save(self, batches: Sequence[Batch]) -> tuple[list[Batch], int]:
        """Spool each of ``batches`` (a spool is needed); returns those it could not write, in
        order, and the rows spooled."""
        kept, spooled = [], 0
        for batch in batches:
            try:
                path = self.spool.save(batch)
            except Exception:  # noqa: BLE001 - a full disk, or a value JSON cannot hold: keep it, go on
                log.exception("usage accounting: spooling %d row(s) to %s failed; kept in memory",
                              len(batch.rows), self.spool.directory)
                kept.append(batch)
                continue
            spooled += len(batch.rows)
            log.warning("usage accounting: %d row(s) not written to the database spooled to %s "
                        "(replayed once it takes them)", len(batch.rows), path)
        return kept, spooled

    def replay(self) -> bool:
        """Write the spooled batches under their ids, deleting each file once written; False at
        the first transient failure (the rest wait for the next call). True without a spool."""
        if self.spool is None:
            return True
        for path in self.spool.files():
            try:
                batch = Batch(*self.spool.load(path))
            except FileNotFoundError:
                continue  # another process sharing this home replayed it
            except SpoolFileError as exc:
                moved_to = self.spool.set_aside(path)
                if moved_to is not None:  # None: another process set it aside first
                    self.spool_files_set_aside += 1
                    log.error("usage accounting: UNREADABLE spool file %s (%s) set aside as %s; its usage is "
                              "not counted until it is repaired and renamed back", path, exc, moved_to)
                continue
            except OSError:
                log.exception("usage accounting: reading spool file %s failed; left for the next flush", path)
                return False
            waiting = deque([batch])
            while waiting:
                result = self.send(waiting[0], f"kept in {path}")
                if result == FAILED:
                    return False  # a row already written by a split is a no-op when replayed: same ids
                sent = waiting.popleft()
                if result == REFUSED:
                    waiting.extendleft(reversed(self.split_or_drop(sent)))
            try:
                self.spool.remove(path)
            except OSError:
                log.exception("usage accounting: could not delete replayed spool file %s (its batch is "
                              "written; replaying it again adds nothing)", path)
            log.info("usage accounting: replayed spooled usage batch %s (%d row(s))", batch.id, len(batch.rows))
        return True
