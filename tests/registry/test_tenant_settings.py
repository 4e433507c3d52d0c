"""Per-tenant serving limits in the registry: stored on the tenant row, defaults, validation,
audit, and the migration that adds them to a database made by the previous schema. SQLite and
PostgreSQL."""

from __future__ import annotations

import math

import pytest
from sqlalchemy import inspect, text

from loraplex.registry import db
from loraplex.registry.errors import InvalidName, InvalidSetting, NotFound


def _rows(url: str, sql: str) -> list[tuple]:
    engine = db.make_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql))]
    finally:
        engine.dispose()


def _stored(url: str) -> dict[str, tuple]:
    rows = _rows(url, "SELECT name, max_concurrent_requests, scheduling_weight FROM tenant")
    return {name: (cap, weight) for name, cap, weight in rows}


def test_new_tenants_get_the_defaults(registry_url, registry_service):
    created = registry_service.create_tenant("acme")
    assert (created.max_concurrent_requests, created.scheduling_weight) == (None, 1.0)
    assert created.to_dict()["max_concurrent_requests"] is None and created.to_dict()["scheduling_weight"] == 1.0
    assert _stored(registry_url) == {"acme": (None, 1.0)}


def test_settings_are_stored_listed_and_audited(registry_url, registry_service):
    registry_service.create_tenant("acme")
    registry_service.create_tenant("batch")
    info = registry_service.update_tenant_settings("acme", {"scheduling_weight": 2}, actor="ops")
    assert (info.name, info.max_concurrent_requests, info.scheduling_weight) == ("acme", None, 2.0)
    registry_service.update_tenant_settings("batch", {"max_concurrent_requests": 3, "scheduling_weight": 0.5})
    assert _stored(registry_url) == {"acme": (None, 2.0), "batch": (3, 0.5)}
    listed = {t.name: (t.max_concurrent_requests, t.scheduling_weight) for t in registry_service.list_tenants()}
    assert listed == {"acme": (None, 2.0), "batch": (3, 0.5)}
    assert registry_service.get_tenant("batch").max_concurrent_requests == 3

    registry_service.update_tenant_settings("batch", {"max_concurrent_requests": None})  # back to the default
    assert _stored(registry_url)["batch"] == (None, 0.5)  # the weight was not given: unchanged

    events = [e for e in registry_service.list_audit() if e.action == "tenant.update"]
    assert [(e.tenant, e.actor, e.object_type, e.object_name, e.detail) for e in events] == [
        ("batch", "admin", "tenant", "batch", {"max_concurrent_requests": {"from": 3, "to": None}}),
        ("batch", "admin", "tenant", "batch",
         {"max_concurrent_requests": {"from": None, "to": 3}, "scheduling_weight": {"from": 1.0, "to": 0.5}}),
        ("acme", "ops", "tenant", "acme", {"scheduling_weight": {"from": 1.0, "to": 2.0}}),
    ]


@pytest.mark.parametrize("changes,param", [
    ({"max_concurrent_requests": 0}, "max_concurrent_requests"),
    ({"max_concurrent_requests": -2}, "max_concurrent_requests"),
    ({"max_concurrent_requests": 100_001}, "max_concurrent_requests"),
    ({"max_concurrent_requests": 2.0}, "max_concurrent_requests"),
    ({"max_concurrent_requests": True}, "max_concurrent_requests"),
    ({"max_concurrent_requests": "4"}, "max_concurrent_requests"),
    ({"scheduling_weight": 0}, "scheduling_weight"),
    ({"scheduling_weight": 0.009}, "scheduling_weight"),
    ({"scheduling_weight": 100.5}, "scheduling_weight"),
    ({"scheduling_weight": math.nan}, "scheduling_weight"),
    ({"scheduling_weight": math.inf}, "scheduling_weight"),
    ({"scheduling_weight": None}, "scheduling_weight"),
    ({"scheduling_weight": False}, "scheduling_weight"),
    ({"scheduling_weight": 2, "max_concurrent_requests": 0}, "max_concurrent_requests"),  # all or nothing
    ({"max_requests_per_minute": 0}, "max_requests_per_minute"),
    ({"max_requests_per_minute": 10_000_001}, "max_requests_per_minute"),
    ({"max_requests_per_minute": 2.0}, "max_requests_per_minute"),
    ({"max_requests_per_minute": "60"}, "max_requests_per_minute"),
    ({"max_requests_per_minute": True}, "max_requests_per_minute"),
    ({"max_tokens_per_minute": -1}, "max_tokens_per_minute"),
    ({"max_tokens_per_minute": 1_000_000_001}, "max_tokens_per_minute"),
    ({"max_tokens_per_minute": 1e3}, "max_tokens_per_minute"),
    ({"max_tokens_per_minute": [100]}, "max_tokens_per_minute"),
    ({"max_requests_per_minute": 5, "max_tokens_per_minute": 0}, "max_tokens_per_minute"),  # all or nothing
    ({"weight": 2}, "weight"),
    ({}, None),
])
def test_bad_settings_are_refused_and_change_nothing(registry_url, registry_service, changes, param):
    registry_service.create_tenant("acme")
    with pytest.raises(InvalidSetting) as err:
        registry_service.update_tenant_settings("acme", changes)
    assert err.value.param == param and err.value.http_status == 400
    if param:
        assert param in str(err.value)
    assert _stored(registry_url) == {"acme": (None, 1.0)}
    assert [e.action for e in registry_service.list_audit()] == ["tenant.create"]


def test_bounds_are_accepted(registry_service):
    registry_service.create_tenant("acme")
    for changes in ({"max_concurrent_requests": 1}, {"max_concurrent_requests": 100_000},
                    {"scheduling_weight": 0.01}, {"scheduling_weight": 100},
                    {"max_requests_per_minute": 1}, {"max_requests_per_minute": 10_000_000},
                    {"max_tokens_per_minute": 1}, {"max_tokens_per_minute": 1_000_000_000}):
        info = registry_service.update_tenant_settings("acme", changes)
        (field, value), = changes.items()
        assert getattr(info, field) == value


def test_unknown_or_invalid_tenant(registry_service):
    with pytest.raises(NotFound):
        registry_service.update_tenant_settings("nobody", {"scheduling_weight": 2})
    with pytest.raises(InvalidName):
        registry_service.update_tenant_settings("../x", {"scheduling_weight": 2})
    assert registry_service.list_audit() == []


def test_previous_schema_upgrades_with_defaults_and_downgrades_keeping_rows(database_url):
    db.upgrade(database_url, "0001")
    engine = db.make_engine(database_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO tenant (id, name, created_at) VALUES (1, 'old', CURRENT_TIMESTAMP)"))
            conn.execute(text("INSERT INTO api_key (tenant_id, secret_sha256, prefix, created_at) "
                              "VALUES (1, :sha, 'lpx_x', CURRENT_TIMESTAMP)"), {"sha": "a" * 64})
    finally:
        engine.dispose()
    db.upgrade(database_url)
    assert _stored(database_url) == {"old": (None, 1.0)}

    from loraplex.registry.service import RegistryService

    engine = db.make_engine(database_url)
    try:
        service = RegistryService(db.make_session_factory(engine))
        assert service.update_tenant_settings("old", {"scheduling_weight": 3}).scheduling_weight == 3.0
    finally:
        engine.dispose()

    db.downgrade(database_url, "0001")  # the columns go; tenants and their keys stay
    assert _rows(database_url, "SELECT name FROM tenant") == [("old",)]
    assert _rows(database_url, "SELECT prefix FROM api_key") == [("lpx_x",)]
    db.upgrade(database_url)
    assert _stored(database_url) == {"old": (None, 1.0)}


def _rates(url: str) -> dict[str, tuple]:
    rows = _rows(url, "SELECT name, max_requests_per_minute, max_tokens_per_minute FROM tenant")
    return {name: (rpm, tpm) for name, rpm, tpm in rows}


def test_rate_limits_default_to_unlimited_and_are_stored_listed_and_audited(registry_url, registry_service):
    created = registry_service.create_tenant("acme")
    assert (created.max_requests_per_minute, created.max_tokens_per_minute) == (None, None)
    assert {"max_requests_per_minute": None, "max_tokens_per_minute": None}.items() <= created.to_dict().items()
    info = registry_service.update_tenant_settings(
        "acme", {"max_requests_per_minute": 60, "max_tokens_per_minute": 40_000}, actor="ops")
    assert (info.max_requests_per_minute, info.max_tokens_per_minute) == (60, 40_000)
    assert _rates(registry_url) == {"acme": (60, 40_000)}
    assert _stored(registry_url) == {"acme": (None, 1.0)}  # the other settings untouched
    registry_service.update_tenant_settings("acme", {"max_tokens_per_minute": None})  # unlimited again
    assert _rates(registry_url) == {"acme": (60, None)}
    listed = registry_service.list_tenants()[0]
    assert (listed.max_requests_per_minute, listed.max_tokens_per_minute) == (60, None)

    events = [e for e in registry_service.list_audit() if e.action == "tenant.update"]
    assert [(e.actor, e.detail) for e in events] == [
        ("admin", {"max_tokens_per_minute": {"from": 40_000, "to": None}}),
        ("ops", {"max_requests_per_minute": {"from": None, "to": 60},
                 "max_tokens_per_minute": {"from": None, "to": 40_000}}),
    ]


def test_the_rate_limit_migration_keeps_tenants_unlimited_and_downgrades_keeping_rows(database_url):
    db.upgrade(database_url, "0004")
    engine = db.make_engine(database_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO tenant (id, name, created_at, max_concurrent_requests, scheduling_weight) "
                              "VALUES (1, 'old', CURRENT_TIMESTAMP, 3, 2)"))
    finally:
        engine.dispose()
    db.upgrade(database_url)
    assert _rates(database_url) == {"old": (None, None)}
    assert _stored(database_url) == {"old": (3, 2.0)}
    db.downgrade(database_url, "0004")
    assert _stored(database_url) == {"old": (3, 2.0)}
    engine = db.make_engine(database_url)
    try:
        columns = {c["name"] for c in inspect(engine).get_columns("tenant")}
    finally:
        engine.dispose()
    assert not {"max_requests_per_minute", "max_tokens_per_minute"} & columns
