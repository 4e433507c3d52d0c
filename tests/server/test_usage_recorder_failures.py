"""UsageRecorder through failures, against a real registry (SQLite and PostgreSQL) whose usage
table is the reference, with the expected sums counted here from the requests recorded:

* a commit whose acknowledgement is lost: the batch is resent under its id and counted once;
* the database down (transient): batches kept unchanged, newer usage added up in memory and
  bounded, the thread backing off, everything written exactly once it is back;
* a value the database refuses (permanent): that row logged and dropped (counted, and exported
  to Prometheus), every other row of the batch written, later batches not held up."""

from __future__ import annotations

import logging
from datetime import datetime, timezone

from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy.exc import OperationalError

from loraplex.registry.service import RegistryService
from loraplex.server.usage_metrics import UsageCollector
from loraplex.server.usage_recorder import UsageRecorder
from tests.registry.helpers import AckLost

H0 = datetime(2026, 12, 3, 14, tzinfo=timezone.utc)


def clock() -> float:
    return H0.timestamp() + 60


def per_tenant(registry) -> dict:
    return {r["tenant"]: (r["requests"], r["prompt_tokens"], r["completion_tokens"])
            for r in registry.usage_report(group_by=["tenant"]).rows}


class Down:
    """A ``write`` in front of the registry that fails, without reaching it, while ``down``."""

    def __init__(self, registry):
        self.registry = registry
        self.down = False
        self.calls: list[str] = []

    def __call__(self, deltas, batch_id):
        self.calls.append(batch_id)
        if self.down:
            raise OperationalError("INSERT", {}, Exception("could not connect to server"))
        return self.registry.record_usage(deltas, batch_id)


def test_a_batch_committed_but_not_acknowledged_is_counted_once(registry_service):
    faults = AckLost(registry_service._session_factory)
    rec = UsageRecorder(RegistryService(faults).record_usage, 3600, clock=clock)
    rec.record("acme", "sql", prompt_tokens=5, completion_tokens=2, ok=True)
    faults.commits_to_fail = 100  # every commit of this flush, the retries' too, loses its answer
    assert rec.flush() is False and rec.failed_flushes == 1 and faults.failed >= 1
    rec.record("acme", "sql", prompt_tokens=1, completion_tokens=1, ok=True)  # meanwhile
    faults.commits_to_fail = 0
    assert rec.flush() is True and rec.pending_rows == 0
    assert per_tenant(registry_service) == {"acme": (2, 6, 3)}


def test_transient_failures_keep_everything_bounded_and_back_off(registry_service):
    write = Down(registry_service)
    rec = UsageRecorder(write, 1.0, max_pending_rows=3, clock=clock, max_backoff_seconds=8)
    write.down = True
    expected = {"a": [0, 0, 0], "b": [0, 0, 0]}
    waits = []
    for i in range(6):  # a long outage: six flushes fail
        for tenant in ("a", "b"):
            rec.record(tenant, "x", prompt_tokens=i, completion_tokens=1, ok=True)
            expected[tenant] = [expected[tenant][0] + 1, expected[tenant][1] + i, expected[tenant][2] + 1]
        assert rec.flush() is False
        waits.append(rec.next_wait())
    assert waits == [2, 4, 8, 8, 8, 8]  # doubling, capped
    assert len(set(write.calls)) == 1  # one batch, resent under its id, never merged with newer usage
    assert rec.pending_rows == 2  # held keys: a and b, in the batch and summed since
    rec.record("c", "x", prompt_tokens=1, completion_tokens=1, ok=True)  # a third key fits
    rec.record("d", "x", prompt_tokens=1, completion_tokens=1, ok=True)  # a fourth does not
    assert rec.pending_rows == 3 and rec.dropped_requests == 1
    write.down = False
    assert rec.flush() is True and rec.next_wait() == 1.0 and rec.pending_rows == 0
    assert per_tenant(registry_service) == {"a": tuple(expected["a"]), "b": tuple(expected["b"]), "c": (1, 1, 1)}


def test_a_refused_row_is_logged_counted_and_dropped_and_the_rest_is_written(registry_service, caplog):
    rec = UsageRecorder(registry_service.record_usage, 3600, clock=clock)
    rec.record("acme", "sql", prompt_tokens=3, completion_tokens=4, ok=True)
    rec.record(None, "sql", prompt_tokens=17, completion_tokens=19, ok=True)  # NOT NULL: refused
    rec.record("other", None, prompt_tokens=1, completion_tokens=0, ok=True)
    with caplog.at_level(logging.ERROR, logger="loraplex.server"):
        assert rec.flush() is True
    assert per_tenant(registry_service) == {"acme": (1, 3, 4), "other": (1, 1, 0)}
    assert rec.stats()["dropped_records"] == 1 and rec.pending_rows == 0 and rec.failed_flushes == 0
    dropped = [r.getMessage() for r in caplog.records if "DROPPED" in r.getMessage()]
    assert len(dropped) == 1 and "tenant=None" in dropped[0] and "prompt_tokens=17" in dropped[0]
    # the queue moves on: later usage is written at the next flush
    rec.record("acme", "sql", prompt_tokens=1, completion_tokens=1, ok=True)
    assert rec.flush() is True and per_tenant(registry_service)["acme"] == (2, 4, 5)
    metrics = CollectorRegistry()
    metrics.register(UsageCollector(rec))
    text = generate_latest(metrics).decode()
    assert "loraplex_usage_records_dropped_total 1.0" in text
    assert "loraplex_usage_pending_rows 0.0" in text


def test_a_refused_batch_after_an_outage_drops_only_the_refused_row(registry_service):
    write = Down(registry_service)
    rec = UsageRecorder(write, 3600, clock=clock)
    write.down = True
    rec.record("acme", "sql", prompt_tokens=2, completion_tokens=2, ok=True)
    rec.record("acme", "sql", prompt_tokens=2, completion_tokens=2, ok=False)
    rec.record("big", "sql", prompt_tokens=2**63, completion_tokens=0, ok=True)  # past BIGINT
    assert rec.flush() is False
    write.down = False
    rec.record("acme", "sql", prompt_tokens=1, completion_tokens=0, ok=True)
    assert rec.flush() is True and rec.dropped_records == 1
    report = registry_service.usage_report(group_by=["tenant"]).rows
    assert [(r["tenant"], r["requests"], r["prompt_tokens"], r["failed_requests"], r["failed_prompt_tokens"])
            for r in report] == [("acme", 2, 3, 1, 2)]
