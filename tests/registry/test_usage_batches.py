"""Usage batches with ids are added once: a commit whose acknowledgement is lost (a fault injected
right after the database committed) and the batch sent again count it once; ids are pruned after
``FLUSH_ID_RETENTION``. On SQLite and PostgreSQL, against sums computed here from the deltas."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from loraplex.registry.errors import InvalidSetting
from loraplex.registry.models import UsageFlush, utcnow
from loraplex.registry.service import RegistryService
from loraplex.registry.usage import COUNTERS, FLUSH_ID_RETENTION, UsageDelta, is_permanent_usage_error
from tests.registry.helpers import AckLost

H0 = datetime(2026, 12, 3, 14, tzinfo=timezone.utc)
BATCH = [UsageDelta("acme", "sql", H0, requests=3, prompt_tokens=30, completion_tokens=7),
         UsageDelta("acme", None, H0, failed_requests=1, failed_prompt_tokens=4)]


def sums(*batches) -> dict[str, int]:
    """What the usage table must total after ``batches`` were each added once."""
    totals = {c: sum(getattr(d, c) for batch in batches for d in batch) for c in COUNTERS}
    totals["total_tokens"] = totals["prompt_tokens"] + totals["completion_tokens"]
    return totals


@pytest.fixture
def faulty(registry_service):
    """``(service, faults)``: a service on the same database whose commits ``faults`` can fail."""
    faults = AckLost(registry_service._session_factory)
    return RegistryService(faults), faults


def test_the_fault_is_real_a_batch_without_an_id_is_counted_twice(registry_service, faulty):
    service, faults = faulty
    faults.commits_to_fail = 1
    service.record_usage(BATCH)  # committed, not acknowledged, retried by record_usage itself
    assert faults.failed == 1
    assert registry_service.usage_report().totals == sums(BATCH, BATCH)


def test_a_batch_whose_commit_was_not_acknowledged_is_not_added_again(registry_service, faulty):
    service, faults = faulty
    faults.commits_to_fail = 1
    assert service.record_usage(BATCH, batch_id="b-1") is False  # the retry found its id: not added again
    assert faults.failed == 1 and registry_service.usage_report().totals == sums(BATCH)
    # the caller saw the write fail every time and sends it again later, as the recorder does
    faults.commits_to_fail = 10
    with pytest.raises(OperationalError):
        service.record_usage(BATCH, batch_id="b-2")
    faults.commits_to_fail = 0
    assert service.record_usage(BATCH, batch_id="b-2") is False
    assert service.record_usage(BATCH, batch_id="b-1") is False
    assert registry_service.usage_report().totals == sums(BATCH, BATCH)
    assert service.record_usage(BATCH, batch_id="b-3") is True
    assert registry_service.usage_report().totals == sums(BATCH, BATCH, BATCH)


def test_batch_ids_are_pruned_after_the_retention(registry_service):
    old, recent = utcnow() - FLUSH_ID_RETENTION - timedelta(hours=1), utcnow() - FLUSH_ID_RETENTION / 2
    with registry_service._transaction() as session:
        session.add_all([UsageFlush(batch_id="old", flushed_at=old), UsageFlush(batch_id="recent", flushed_at=recent)])
    assert registry_service.record_usage(BATCH, batch_id="new") is True
    with registry_service._transaction() as session:
        assert sorted(session.scalars(select(UsageFlush.batch_id))) == ["new", "recent"]
    assert registry_service.record_usage(BATCH, batch_id="recent") is False  # still remembered
    assert registry_service.usage_report().totals == sums(BATCH)


def test_a_malformed_batch_id_changes_nothing(registry_service):
    for bad in ("", "x" * 65, 7):
        with pytest.raises(InvalidSetting):
            registry_service.record_usage(BATCH, batch_id=bad)
    assert registry_service.usage_report().rows == []


def test_what_the_database_refuses_is_permanent_and_a_lost_connection_is_not(registry_service):
    refused = []
    for bad in (UsageDelta(None, "sql", H0, requests=1),  # NOT NULL tenant
                UsageDelta("acme", "sql", H0, requests=2**63)):  # past BIGINT
        with pytest.raises(Exception) as caught:
            registry_service.record_usage([bad], batch_id=f"bad-{len(refused)}")
        refused.append(caught.value)
    assert all(is_permanent_usage_error(exc) for exc in refused), refused
    assert not is_permanent_usage_error(OperationalError("INSERT", {}, Exception("connection refused")))
    assert registry_service.usage_report().rows == []
