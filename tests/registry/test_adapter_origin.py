"""Adapter.origin: the runtime endpoints' writes (``origin="runtime_load"``) may change only the
adapters they created; the operator's writes take a runtime adapter over. Checked on SQLite and
PostgreSQL against the rule in loraplex/registry/adapter_origin.py, with what the registry holds
(versions, active version, audit trail) as the reference; and migration 0007's backfill."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from loraplex.registry import db
from loraplex.registry.errors import AlreadyExists, ManagedByOperator
from loraplex.registry.models import ADAPTER_ORIGIN_RUNTIME as RUNTIME
from loraplex.storage.base import content_key, open_blob_store
from tests.registry.adapter_manager_helpers import make_manager
from tests.registry.helpers import version_fields


def state(registry, tenant="acme"):
    return registry.list_adapters(tenant), registry.list_audit(tenant, limit=1000)


def test_runtime_writes_to_an_operators_adapter_are_refused_and_change_nothing(registry):
    registry.add_version("acme", "sql", **version_fields(b"one"))  # the operator's (origin None)
    registry.add_version("acme", "sql", **version_fields(b"two"))
    assert registry.get_adapter("acme", "sql").origin is None
    before = state(registry)
    with pytest.raises(ManagedByOperator, match="'sql'"):
        registry.add_version("acme", "sql", origin=RUNTIME, **version_fields(b"three"))
    with pytest.raises(ManagedByOperator):  # identical weights too: nothing to learn from it
        registry.add_version("acme", "sql", origin=RUNTIME, **version_fields(b"one"))
    with pytest.raises(ManagedByOperator):
        registry.activate("acme", "sql", 2, origin=RUNTIME)
    with pytest.raises(ManagedByOperator):
        registry.delete_adapter("acme", "sql", origin=RUNTIME)
    assert state(registry) == before


def test_a_runtime_adapter_is_the_runtimes_until_the_operator_uploads_to_it(registry):
    registry.add_version("acme", "rt", origin=RUNTIME, **version_fields(b"one"))
    registry.add_version("acme", "rt", origin=RUNTIME, **version_fields(b"two"))
    registry.activate("acme", "rt", 2, origin=RUNTIME)
    assert registry.get_adapter("acme", "rt").origin == RUNTIME
    registry.activate("acme", "rt", 1)  # an operator hot-swap leaves it the tenant's
    assert registry.get_adapter("acme", "rt").origin == RUNTIME
    registry.add_version("acme", "rt", **version_fields(b"one"))  # an operator upload, even of known weights
    assert registry.get_adapter("acme", "rt").origin is None
    with pytest.raises(ManagedByOperator):
        registry.delete_adapter("acme", "rt", origin=RUNTIME)
    assert [v.version for v in registry.get_adapter("acme", "rt").versions] == [1, 2]


def test_a_deleted_name_belongs_to_whoever_creates_it_again(registry):
    registry.add_version("acme", "sql", **version_fields(b"one"))
    registry.delete_adapter("acme", "sql")
    registry.add_version("acme", "sql", origin=RUNTIME, **version_fields(b"two"))
    assert registry.get_adapter("acme", "sql").origin == RUNTIME
    removed = registry.delete_adapter("acme", "sql", origin=RUNTIME)
    assert [v.version for v in removed] == [2] and registry.get_adapter("acme", "sql") is None
    registry.add_version("acme", "sql", **version_fields(b"three"))
    assert registry.get_adapter("acme", "sql").origin is None
    # another tenant's adapter of the same name is its own
    registry.add_version("other", "sql", origin=RUNTIME, **version_fields(b"three"))
    assert registry.get_adapter("other", "sql").origin == RUNTIME


def _insert_adapter(conn, name: str, deleted: bool, versions: list[tuple[str, str]]) -> None:
    """An adapter of tenant acme with ``versions`` as (uploader, state), in the 0006 schema."""
    conn.exec_driver_sql(
        "INSERT INTO adapter (tenant_id, name, created_at, deleted_at) SELECT id, %s, CURRENT_TIMESTAMP, %s "
        "FROM tenant WHERE name = 'acme'" % (f"'{name}'", "CURRENT_TIMESTAMP" if deleted else "NULL"))
    for number, (uploader, version_state) in enumerate(versions, start=1):
        conn.exec_driver_sql(
            "INSERT INTO adapter_version (adapter_id, number, sha256, base_model, rank, alpha, targets, size_bytes, "
            "blob_key, uploader, created_at, state) SELECT a.id, %d, '%s', 'm', 4, 8.0, '[]', 1, 'k', '%s', "
            "CURRENT_TIMESTAMP, '%s' FROM adapter a WHERE a.name = '%s'"
            % (number, f"{number:064x}", uploader, version_state, name))


def test_migration_0007_marks_adapters_only_runtime_loads_made(database_url):
    from loraplex.registry.service import RegistryService

    db.upgrade(database_url, "0006")
    engine = db.make_engine(database_url)
    load, admin = "load_lora_adapter", "admin"
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("INSERT INTO tenant (name, created_at) VALUES ('acme', CURRENT_TIMESTAMP)")
            _insert_adapter(conn, "runtime", False, [(load, "ready"), (load, "ready")])
            _insert_adapter(conn, "mixed", False, [(load, "ready"), (admin, "ready")])
            _insert_adapter(conn, "operator", False, [(admin, "ready")])
            _insert_adapter(conn, "reloaded", False, [(admin, "deleted"), (load, "ready")])
            _insert_adapter(conn, "gone", True, [(load, "deleted")])
    finally:
        engine.dispose()
    db.upgrade(database_url)
    service = RegistryService.from_url(database_url)
    origins = {a.name: a.origin for a in service.list_adapters("acme")}
    assert origins == {"runtime": RUNTIME, "mixed": None, "operator": None, "reloaded": RUNTIME}
    db.downgrade(database_url, "0006")  # and back: the column goes, the adapters stay
    db.upgrade(database_url)
    assert {a.name for a in RegistryService.from_url(database_url).list_adapters("acme")} == set(origins)


def test_of_concurrent_create_only_loads_of_a_new_name_one_creates_it(registry, adapters, tmp_path):
    """vLLM's load without ``load_inplace``, four at once with two sets of weights: one load
    creates the name, the others are refused (``AlreadyExists``) and leave no version and no
    blob of their own (each load used to pass the route's check and add a version)."""
    spec, dirs = adapters
    blobs = open_blob_store(str(tmp_path / "blobs"))
    manager = make_manager(registry, blobs, tmp_path / "cache", spec)
    barrier = threading.Barrier(4)

    def load(which: str):
        barrier.wait()
        try:
            return manager.upload_active("acme", "rt", dirs[which], origin=RUNTIME, create_only=True)
        except AlreadyExists as exc:
            return exc

    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(load, ["a", "b", "a", "b"]))
    won = [o for o in outcomes if not isinstance(o, AlreadyExists)]
    assert len(won) == 1, outcomes
    adapter = registry.get_adapter("acme", "rt")
    assert [v.version for v in adapter.versions] == [1] and adapter.active_version == 1
    assert adapter.versions[0].sha256 == won[0][0].sha256
    # the refused loads' blobs went again: only the winner's bytes are stored
    assert {b.key for b in blobs.list_blobs()} == {content_key(won[0][0].sha256)}
    # a deleted name is new again
    registry.delete_adapter("acme", "rt", origin=RUNTIME)
    version, created, _ = manager.upload_active("acme", "rt", dirs["b"], origin=RUNTIME, create_only=True)
    assert created and registry.resolve("acme", "rt").version == version.version == 2
