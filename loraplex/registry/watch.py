"""Cross-process change detection: poll the registry's change counter.

Every hot-swap and delete bumps ``registry_state.change_counter`` in the same transaction, so a
process that sees the counter move knows its cached name -> version mappings may be stale.
A poll of one indexed row every ``interval`` seconds is cheap and works on every backend
(PostgreSQL LISTEN/NOTIFY would be faster but needs a dedicated connection per process).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

logger = logging.getLogger(__name__)


class _CounterSource(Protocol):
    def change_counter(self) -> int: ...


class RegistryWatcher:
    """Calls ``on_change(counter)`` from a background thread whenever the change counter moves.

    Use as a context manager or call ``start()``/``stop()``. Errors reading the counter (database
    briefly down) are retried on the next tick and logged once per outage; errors in
    ``on_change`` are logged.
    """

    def __init__(self, service: _CounterSource, interval: float, on_change: Callable[[int], None]):
        if interval <= 0:
            raise ValueError("interval must be positive")
        self._service = service
        self._interval = interval
        self._on_change = on_change
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_counter: int | None = None

    def poll_once(self) -> bool:
        """Read the counter; call ``on_change`` and return True if it moved since the last read.
        A callback that raises is logged and called again at the next poll."""
        counter = self._service.change_counter()
        previous, self.last_counter = self.last_counter, counter
        if previous is None or counter == previous:
            return False
        try:
            self._on_change(counter)
        except Exception:
            logger.exception("registry on_change callback failed; calling it again at the next poll")
            self.last_counter = previous
        return True

    def _run(self) -> None:
        failures = 0  # polls failed in a row: an outage is logged once, and its end
        while not self._stop.wait(self._interval):
            try:
                self.poll_once()
            except Exception:
                failures += 1
                if failures == 1:
                    logger.warning("registry change poll failed; retrying every %.1f s", self._interval,
                                   exc_info=True)
                continue
            if failures:
                logger.info("registry change poll back after %d failure(s)", failures)
                failures = 0

    def start(self) -> RegistryWatcher:
        if self._thread is not None:
            raise RuntimeError("watcher already started")
        self.last_counter = self._service.change_counter()  # baseline: changes from now on
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="registry-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def __enter__(self) -> RegistryWatcher:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
