"""Periodic garbage collection of adapter blobs no live version uses.

``AdapterManager.collect_garbage`` removes blobs left by a crash between blob put and row insert,
or by a delete that was deferred until the last request released the version in a process that
then stopped. The server runs it in a background thread (never on the event loop): first
``min(60 s, interval)`` after start, then every ``blob_gc_interval_seconds`` (0 disables it);
blobs younger than ``blob_gc_min_age_seconds`` stay, since an upload stores its blob before its
row. Each delete counts and deletes under the blob's database lock, so replicas sharing the
database and store may all run it. Errors are logged and retried at the next run; ``stop()``
ends the thread (a pass in progress stops at the next blob).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("loraplex.server")

INITIAL_DELAY_S = 60.0  # after start, so a restart loop does not list the store every time


class BlobGarbageCollector:
    """Calls ``collect(min_age_seconds=..., stop=...)`` from a daemon thread, every
    ``interval_seconds`` after ``initial_delay_seconds`` (default ``min(60, interval)``)."""

    def __init__(
        self,
        collect: Callable[..., list[str]],
        interval_seconds: float,
        min_age_seconds: float,
        initial_delay_seconds: float | None = None,
    ):
        if interval_seconds <= 0:
            raise ValueError("interval_seconds must be positive (0 means: do not create a collector)")
        self._collect = collect
        self.interval_seconds = float(interval_seconds)
        self.min_age_seconds = float(min_age_seconds)
        self.initial_delay_seconds = (
            min(INITIAL_DELAY_S, self.interval_seconds) if initial_delay_seconds is None else float(initial_delay_seconds)
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.runs = 0
        self.errors = 0
        self.deleted_total = 0
        self.last_run_at: float | None = None

    def run_once(self) -> list[str]:
        """One pass; errors are logged (and counted), never raised."""
        started = time.monotonic()
        try:
            deleted = self._collect(min_age_seconds=self.min_age_seconds, stop=self._stop)
        except Exception:  # noqa: BLE001 - the next run retries; the server keeps serving
            self.errors += 1
            log.exception("blob garbage collection failed; retrying in %.0fs", self.interval_seconds)
            deleted = []
        else:
            self.deleted_total += len(deleted)
            log.log(
                logging.INFO if deleted else logging.DEBUG,
                "blob garbage collection: %d unreferenced blob(s) deleted in %.2fs",
                len(deleted), time.monotonic() - started,
            )
        self.runs += 1
        self.last_run_at = time.time()
        return deleted

    def _run(self) -> None:
        delay = self.initial_delay_seconds
        while not self._stop.wait(delay):
            self.run_once()
            delay = self.interval_seconds

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> BlobGarbageCollector:
        if self._thread is not None:
            raise RuntimeError("collector already started")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="blob-gc", daemon=True)
        self._thread.start()
        log.info(
            "blob garbage collection every %.0fs (first in %.0fs, min age %.0fs)",
            self.interval_seconds, self.initial_delay_seconds, self.min_age_seconds,
        )
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("blob garbage collection still running after %.0fs; not waiting", timeout or 0)

    def __enter__(self) -> BlobGarbageCollector:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
