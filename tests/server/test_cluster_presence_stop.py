"""Stopping a replica's heartbeats while one is still in a database call (a slow or unreachable
database at shutdown), against the registry's own table (SQLite and PostgreSQL): the replica's
row must be gone once that heartbeat returns, not written back after the leave, and ``stop``
must not wait on the database past its timeout."""

from __future__ import annotations

import threading
import time

from sqlalchemy import text

from loraplex.server.cluster_presence import ClusterPresence


def _rows(service) -> set[str]:
    with service._transaction() as session:
        return {r for (r,) in session.execute(text("SELECT replica_id FROM replica_heartbeats"))}


class SlowDatabase:
    """The registry's heartbeat and leave, each held at ``gate`` once ``slow`` is set (a database
    call that takes as long as the test wants)."""

    def __init__(self, service):
        self.service = service
        self.slow = False
        self.gate = threading.Event()
        self.beat_waiting = threading.Event()

    def beat(self, replica_id: str, ttl: float) -> int:
        if self.slow:
            self.beat_waiting.set()
            self.gate.wait(30)
        return self.service.replica_heartbeat(replica_id, ttl)

    def leave(self, replica_id: str) -> None:
        if self.slow:
            self.gate.wait(30)
        self.service.replica_leave(replica_id)


def test_a_heartbeat_in_flight_at_stop_does_not_bring_the_row_back(registry_service):
    database = SlowDatabase(registry_service)
    presence = ClusterPresence(database.beat, database.leave, 0.05, ttl_seconds=60, replica_id="me").start()
    assert _rows(registry_service) == {"me"}
    database.slow = True
    assert database.beat_waiting.wait(10)  # the thread's heartbeat is in its database call
    database.slow = False  # the leave itself is quick
    presence.stop(timeout=0.2)  # gives up waiting for the heartbeat
    database.gate.set()  # the heartbeat's call returns
    deadline = time.monotonic() + 10
    while any(t.name == "replica-heartbeat" and t.is_alive() for t in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # a stopped replica is no longer counted: its row must not outlive the stop
    assert _rows(registry_service) == set()
    assert registry_service.replica_heartbeat("other", 60) == 1


def test_stop_returns_within_its_timeout_while_the_database_hangs(registry_service):
    database = SlowDatabase(registry_service)
    presence = ClusterPresence(database.beat, database.leave, 0.05, ttl_seconds=60, replica_id="me").start()
    database.slow = True
    threading.Timer(3.0, database.gate.set).start()
    started = time.monotonic()
    presence.stop(timeout=0.3)
    took = time.monotonic() - started
    assert took < 2.0, f"stop waited {took:.1f}s on the database"
    deadline = time.monotonic() + 10  # the database answers again: the row goes
    while _rows(registry_service) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _rows(registry_service) == set()
