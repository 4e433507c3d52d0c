"""UsageRecorder: sums per (tenant, adapter, hour), written in batches by its thread or at stop,
kept through failed writes, bounded in memory; against a real registry where the database's
contents are the reference."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy.exc import OperationalError

from loraplex.registry.usage import UsageDelta
from loraplex.server.usage_recorder import UsageRecorder

H0 = datetime(2026, 12, 3, 14, tzinfo=timezone.utc)


class Clock:
    def __init__(self, at: datetime):
        self.now = at.timestamp()

    def __call__(self) -> float:
        return self.now


class Writes:
    """A ``write`` that keeps each batch (as {key: counts}) and can fail the next calls."""

    def __init__(self, fail: int = 0):
        self.batches: list[dict] = []
        self.fail = fail
        self.called = threading.Event()

    def __call__(self, deltas, batch_id=None) -> None:
        self.called.set()
        if self.fail:
            self.fail -= 1
            raise OperationalError("INSERT", {}, Exception("database is down"))
        self.batches.append({(d.tenant, d.adapter, d.hour): tuple(d.counts().values()) for d in deltas})


def test_sums_per_tenant_adapter_and_hour():
    clock, writes = Clock(H0 + timedelta(minutes=10)), Writes()
    rec = UsageRecorder(writes, 3600, clock=clock)
    rec.record("acme", "sql", prompt_tokens=5, completion_tokens=2, ok=True)
    rec.record("acme", "sql", prompt_tokens=7, completion_tokens=3, ok=True)
    rec.record("acme", "sql", prompt_tokens=4, completion_tokens=1, ok=False)
    rec.record("acme", None, prompt_tokens=1, completion_tokens=1, ok=True)
    clock.now += 3600  # the next hour
    rec.record("acme", "sql", prompt_tokens=9, completion_tokens=9, ok=True)
    assert writes.batches == [] and rec.pending_rows == 3  # nothing written per request
    assert rec.flush() is True
    assert writes.batches == [{
        ("acme", "sql", H0): (2, 12, 5, 1, 4, 1),
        ("acme", None, H0): (1, 1, 1, 0, 0, 0),
        ("acme", "sql", H0 + timedelta(hours=1)): (1, 9, 9, 0, 0, 0),
    }]
    assert rec.flush() is True and len(writes.batches) == 1  # an empty flush writes nothing


def test_thread_flushes_every_interval_not_per_request():
    writes = Writes()
    rec = UsageRecorder(writes, 0.2, clock=Clock(H0)).start()
    try:
        for _ in range(50):
            rec.record("acme", "sql", prompt_tokens=1, completion_tokens=2, ok=True)
        assert writes.called.wait(5), "the thread never flushed"
        deadline = time.monotonic() + 5
        while rec.pending_rows and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        rec.stop()
    assert writes.batches == [{("acme", "sql", H0): (50, 50, 100, 0, 0, 0)}]
    assert not rec.running


def test_stop_flushes_what_is_left(registry_service):
    rec = UsageRecorder(registry_service.record_usage, 3600, clock=Clock(H0)).start()
    rec.record("acme", "sql", prompt_tokens=3, completion_tokens=4, ok=True)
    rec.record("other", None, prompt_tokens=1, completion_tokens=0, ok=False)
    assert registry_service.usage_report().rows == []  # an hour before the thread's first flush
    assert rec.stop() is True
    report = registry_service.usage_report(group_by=["tenant"])
    assert [(r["tenant"], r["requests"], r["prompt_tokens"], r["completion_tokens"], r["failed_requests"],
             r["failed_prompt_tokens"]) for r in report.rows] == [("acme", 1, 3, 4, 0, 0), ("other", 0, 0, 0, 1, 1)]


def test_failed_flush_keeps_the_counts_for_the_next(registry_service):
    down = {"calls": 2}

    def flaky_write(deltas, batch_id) -> None:
        if down["calls"]:
            down["calls"] -= 1
            raise OperationalError("INSERT", {}, Exception("connection refused"))
        registry_service.record_usage(deltas, batch_id)

    rec = UsageRecorder(flaky_write, 3600, clock=Clock(H0))
    rec.record("acme", "sql", prompt_tokens=2, completion_tokens=3, ok=True)
    assert rec.flush() is False and rec.failed_flushes == 1
    rec.record("acme", "sql", prompt_tokens=5, completion_tokens=1, ok=True)  # arrives during the outage
    assert rec.flush() is False and rec.pending_rows == 1
    assert rec.flush() is True and rec.pending_rows == 0
    assert registry_service.usage_report().totals == {
        "requests": 2, "prompt_tokens": 7, "completion_tokens": 4, "failed_requests": 0,
        "failed_prompt_tokens": 0, "failed_completion_tokens": 0, "total_tokens": 11}


def test_pending_rows_are_bounded_through_an_outage():
    writes = Writes(fail=1)
    rec = UsageRecorder(writes, 3600, max_pending_rows=2, clock=Clock(H0))
    rec.record("a", "x", prompt_tokens=1, completion_tokens=1, ok=True)
    rec.record("b", "x", prompt_tokens=1, completion_tokens=1, ok=True)
    rec.record("c", "x", prompt_tokens=1, completion_tokens=1, ok=True)  # a third row: over the bound
    rec.record("a", "x", prompt_tokens=1, completion_tokens=1, ok=False)  # a held row still adds up
    assert rec.pending_rows == 2 and rec.dropped_requests == 1
    assert rec.flush() is False  # the two rows go back; they fit
    rec.record("d", "x", prompt_tokens=1, completion_tokens=1, ok=True)
    assert rec.pending_rows == 2 and rec.dropped_requests == 2
    assert rec.flush() is True
    assert writes.batches == [{("a", "x", H0): (1, 1, 1, 1, 1, 1), ("b", "x", H0): (1, 1, 1, 0, 0, 0)}]
    assert rec.stats() == {"flush_seconds": 3600.0, "pending_rows": 0, "flushes": 1, "failed_flushes": 1,
                           "dropped_requests": 2, "dropped_records": 0,  # no spool: dropped, not spooled
                           "spool_dir": None, "spooled_batches": 0, "spool_files_set_aside": 0}


def test_interval_must_be_positive():
    with pytest.raises(ValueError):
        UsageRecorder(Writes(), 0)


def test_deltas_are_registry_deltas():
    writes = []
    rec = UsageRecorder(lambda deltas, batch_id: writes.extend(deltas), 3600, clock=Clock(H0))
    rec.record("acme", None, prompt_tokens=1, completion_tokens=2, ok=True)
    rec.flush()
    assert writes == [UsageDelta("acme", None, H0, requests=1, prompt_tokens=1, completion_tokens=2)]
