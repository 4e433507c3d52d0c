"""This replica's count of the live replicas, for tenant limits that hold for the whole deployment
(``--tenant-limits-scope cluster``).

Every ``interval_seconds`` (``registry_poll_seconds``) a daemon thread writes this replica's
heartbeat to the registry and reads back how many replicas were seen within ``ttl_seconds``
(``RegistryService.replica_heartbeat``); admission divides each tenant's limits by that count
(rate_limits.py, tenant_limits.py), reading only ``live``, so no request waits on the database.
The first heartbeat runs in ``start``, before the server takes requests; ``stop`` deletes this
replica's row so the others take over its share at their next heartbeat (the server stops it as
its SIGTERM drain starts, and again at shutdown, where a second stop only deletes the row again). A replica that dies
stops being counted ``ttl_seconds`` after its last heartbeat, so the others' shares grow back
within ``ttl_seconds + interval_seconds``.

A failed heartbeat (database down) changes nothing here: ``live`` keeps its last value, so
requests are admitted as before, each replica within its last share, and the failure is logged
once per outage. If the outage outlasts ``ttl_seconds``, the other replicas, if they reach the
database, stop counting this one and admit more; the deployment then admits up to one share
too many per unreachable replica until its heartbeats get through again.
"""

from __future__ import annotations

import logging
import socket
import threading
import uuid
from collections.abc import Callable

log = logging.getLogger("loraplex.server")

# a replica is counted while seen within this many heartbeat intervals: one slow or failed
# heartbeat does not drop it from the others' counts
TTL_INTERVALS = 3


def new_replica_id() -> str:
    """The host name (which a pod's is), for operators, and a random part: a restarted process
    on the same host is a new replica, whose predecessor's row expires on its own."""
    return f"{socket.gethostname()[:40]}-{uuid.uuid4().hex[:12]}"


class ClusterPresence:
    """Keeps ``live``, the replicas sharing the tenant limits (1 until the first heartbeat), by
    calling ``beat(replica_id, ttl_seconds) -> live`` every ``interval_seconds`` from a daemon
    thread (``start``/``stop``); ``leave(replica_id)`` from that thread once
    ``stop`` ends it, after its last heartbeat."""

    def __init__(self, beat: Callable[[str, float], int], leave: Callable[[str], None], interval_seconds: float,
                 *, ttl_seconds: float | None = None, replica_id: str | None = None):
        if interval_seconds <= 0:
            raise ValueError("interval_seconds must be positive")
        self._beat = beat
        self._leave = leave
        self.interval_seconds = float(interval_seconds)
        self.ttl_seconds = float(ttl_seconds) if ttl_seconds is not None else TTL_INTERVALS * self.interval_seconds
        self.replica_id = replica_id or new_replica_id()
        self.live = 1
        self.failures = 0  # heartbeats failed in a row
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat_once(self) -> bool:
        """One heartbeat; False (``live`` unchanged, the error logged) when it failed."""
        try:
            live = int(self._beat(self.replica_id, self.ttl_seconds))
        except Exception:  # noqa: BLE001 - the next heartbeat retries; admission goes on
            self.failures += 1
            if self.failures == 1:
                log.warning("replica heartbeat failed; tenant limits keep this replica's share of %d replica(s) "
                            "until one gets through", self.live, exc_info=True)
            return False
        if self.failures:
            log.info("replica heartbeat back after %d failure(s)", self.failures)
        self.failures = 0
        if live != self.live:
            log.info("tenant limits: %d live replica(s) share them (was %d)", live, self.live)
        self.live = max(1, live)
        return True

    def _run(self, stop: threading.Event) -> None:
        try:
            while not stop.wait(self.interval_seconds):
                self.beat_once()
        finally:
            # here, after the last heartbeat has returned: a leave made while a heartbeat was
            # still in its database call would be undone by it (its update finds no row and
            # inserts one), and the others would count a stopped replica for ttl_seconds
            self._leave_now()

    def _leave_now(self) -> None:
        try:
            self._leave(self.replica_id)
        except Exception:  # noqa: BLE001 - shutting down; the row expires on its own
            log.warning("could not remove this replica's heartbeat; the others count it for %.0fs more",
                        self.ttl_seconds, exc_info=True)

    def start(self) -> ClusterPresence:
        if self._thread is not None:
            raise RuntimeError("cluster presence already started")
        self.beat_once()
        # an event per thread: a thread a timed-out stop left in a database call ends when that
        # returns, even if this object is started again meanwhile
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(self._stop,), name="replica-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        """End the heartbeats; the thread deletes this replica's row after its last one (logged,
        not raised, if that fails: the row then expires after ``ttl_seconds``). Waits at most
        ``timeout`` for that: a thread still in a database call then leaves when the call
        returns, and the shutdown goes on without waiting on the database."""
        thread, self._thread = self._thread, None
        if thread is None:  # never started: no thread to leave for it
            self._leave_now()
            return
        self._stop.set()
        thread.join(timeout)
        if thread.is_alive():
            log.warning("replica heartbeat still in a database call after %.1fs; this replica's row goes "
                        "when it returns (or expires after %.0fs)", timeout, self.ttl_seconds)
