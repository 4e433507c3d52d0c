"""Replica heartbeats in the registry (SQLite and PostgreSQL): the live count each replica reads
back, a replica leaving, one going silent expiring after the TTL, the rows the table keeps,
and the database clock the rows are stamped with."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import text

from loraplex.registry.errors import InvalidSetting


def _rows(service) -> dict[str, float]:
    with service._transaction() as session:
        return dict(session.execute(text("SELECT replica_id, last_seen FROM replica_heartbeats")).all())


def test_each_replica_counts_every_live_one(registry_service):
    assert registry_service.replica_heartbeat("a", 60) == 1
    assert registry_service.replica_heartbeat("b", 60) == 2
    assert registry_service.replica_heartbeat("c", 60) == 3
    assert registry_service.replica_heartbeat("a", 60) == 3  # a second heartbeat is not a new replica
    assert set(_rows(registry_service)) == {"a", "b", "c"}
    assert registry_service.replicas_seen(60) == ["a", "b", "c"]


def test_a_replica_leaving_is_no_longer_counted(registry_service):
    for replica in ("a", "b"):
        registry_service.replica_heartbeat(replica, 60)
    registry_service.replica_leave("b")
    assert set(_rows(registry_service)) == {"a"}
    assert registry_service.replica_heartbeat("a", 60) == 1
    registry_service.replica_leave("b")  # twice, or never there: nothing to do


def test_a_silent_replica_expires_after_the_ttl_and_its_row_goes(registry_service):
    ttl = 0.5
    registry_service.replica_heartbeat("silent", ttl)
    assert registry_service.replica_heartbeat("a", ttl) == 2  # within the TTL: still counted
    time.sleep(ttl + 0.2)
    assert registry_service.replica_heartbeat("a", ttl) == 1
    assert set(_rows(registry_service)) == {"a"}
    assert registry_service.replica_heartbeat("silent", ttl) == 2  # back: counted again


def test_rows_carry_the_database_clock_in_epoch_seconds(registry_service):
    # the database runs on this machine, so its clock is this one's
    before = time.time()
    registry_service.replica_heartbeat("a", 60)
    after = time.time()
    seen = _rows(registry_service)["a"]
    assert before - 1.0 <= seen <= after + 1.0
    time.sleep(0.05)
    registry_service.replica_heartbeat("a", 60)
    assert _rows(registry_service)["a"] - seen >= 0.04  # milliseconds, not whole seconds


@pytest.mark.parametrize("replica_id", ["", "x" * 65, None])
def test_a_bad_replica_id_is_refused_and_writes_nothing(registry_service, replica_id):
    with pytest.raises(InvalidSetting):
        registry_service.replica_heartbeat(replica_id, 60)
    assert _rows(registry_service) == {}


def test_a_ttl_that_is_not_positive_is_refused(registry_service):
    with pytest.raises(InvalidSetting):
        registry_service.replica_heartbeat("a", 0)
    assert _rows(registry_service) == {}
