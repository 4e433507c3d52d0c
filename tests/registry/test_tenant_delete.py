"""Tenant offboarding (``delete_tenant``) on SQLite and PostgreSQL, checked against the database's
rows and the blob store's contents: keys revoked, adapters and versions deleted, a blob shared
with another tenant kept, an unshared one deleted (after the request using it ends), usage kept,
the name never reused, bad input changing nothing, and uploads or key creations racing the delete
adding nothing live to the deleted tenant."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import select

from loraplex.registry.errors import Conflict, InvalidName, NotFound, TenantDeleted
from loraplex.registry import repository as repo
from loraplex.registry.models import VERSION_DELETED, Adapter, AdapterVersion, ApiKey, AuditEvent, Tenant, utcnow
from loraplex.registry.usage import UsageDelta, hour_of
from loraplex.storage.base import open_blob_store
from tests.registry.adapter_manager_helpers import make_manager
from tests.registry.helpers import version_fields


def _rows(registry, model, *where):
    with registry._transaction() as session:
        return list(session.scalars(select(model).where(*where)))


def _tenant_id(registry, name: str) -> int:
    return _rows(registry, Tenant, Tenant.name == name)[0].id


def _versions_of(registry, tenant: str) -> list[AdapterVersion]:
    adapter_ids = [a.id for a in _rows(registry, Adapter, Adapter.tenant_id == _tenant_id(registry, tenant))]
    return _rows(registry, AdapterVersion, AdapterVersion.adapter_id.in_(adapter_ids))


def test_delete_tenant_revokes_deletes_and_keeps_what_others_use(registry, adapters, tmp_path):
    spec, dirs = adapters
    blobs = open_blob_store(str(tmp_path / "blobs"))
    manager = make_manager(registry, blobs, tmp_path / "cache", spec)
    shared, _ = manager.upload("acme", "shared", dirs["a"])
    own, _ = manager.upload("acme", "own", dirs["b"])
    theirs, _ = manager.upload("other", "theirs", dirs["a"])  # same bytes as acme/shared: one blob
    assert shared.blob_key == theirs.blob_key != own.blob_key
    (_, key1), (old, _) = registry.create_api_key("acme"), registry.create_api_key("acme")
    registry.revoke_api_key("acme", old.id)
    _, other_key = registry.create_api_key("other")
    hour = hour_of(shared.created_at)
    registry.record_usage([UsageDelta("acme", "own", hour, requests=3, prompt_tokens=30, completion_tokens=9)])
    counter = registry.change_counter()

    running = manager.resolve("acme", "own", acquire=True)  # a request in flight on acme/own
    deletion = manager.delete_tenant("acme", actor="ops")
    assert deletion.counts() == {"api_keys_revoked": 1, "adapters_deleted": 2, "versions_deleted": 2}
    assert sorted(deletion.adapters) == ["own", "shared"]
    assert {v.sha256 for v in deletion.versions} == {shared.sha256, own.sha256}

    # the database: every key revoked, every version tombstoned, every adapter and the tenant deleted
    acme_id = _tenant_id(registry, "acme")
    assert all(k.revoked_at is not None for k in _rows(registry, ApiKey, ApiKey.tenant_id == acme_id))
    assert {(v.state, v.deleted_at is not None) for v in _versions_of(registry, "acme")} == {(VERSION_DELETED, True)}
    assert all(a.deleted_at is not None and a.active_version is None
               for a in _rows(registry, Adapter, Adapter.tenant_id == acme_id))
    assert _rows(registry, Tenant, Tenant.name == "acme")[0].deleted_at is not None
    assert registry.change_counter() > counter
    event = _rows(registry, AuditEvent, AuditEvent.action == "tenant.delete")
    assert [(e.tenant, e.actor, e.detail) for e in event] == [("acme", "ops", deletion.counts())]

    # through the service: the name no longer authenticates, lists or resolves
    assert registry.authenticate(key1) is None and registry.get_tenant("acme") is None
    assert [t.name for t in registry.list_tenants()] == ["other"]
    with pytest.raises(NotFound):
        registry.list_adapters("acme")
    with pytest.raises(NotFound):
        registry.resolve("acme", "shared")

    # blobs: the shared one stays; the unshared one waits for the running request, then goes
    assert blobs.exists(shared.blob_key) and blobs.exists(own.blob_key)
    manager.release(running.content_hash)
    assert not blobs.exists(own.blob_key) and manager.tier_of(own.sha256) == "store"
    assert blobs.exists(shared.blob_key)

    # the other tenant is untouched; usage of the deleted tenant is kept for billing
    assert registry.authenticate(other_key) == "other"
    assert registry.resolve("other", "theirs") == theirs
    assert [v.state for v in _versions_of(registry, "other")] == ["ready"]
    report = registry.usage_report(tenant="acme", group_by=["adapter"])
    assert [(r["adapter"], r["requests"], r["total_tokens"]) for r in report.rows] == [("own", 3, 39)]


def test_deleted_name_is_never_reused(registry):
    registry.add_version("acme", "sql", **version_fields(b"one"))
    registry.update_tenant_settings("acme", {"scheduling_weight": 3})
    registry.delete_tenant("acme")
    with pytest.raises(TenantDeleted, match="never reused") as refused:
        registry.create_tenant("acme")
    assert refused.value.http_status == 409
    with pytest.raises(TenantDeleted):
        # `serve --vllm-tenant acme` at its next start: refused, not recreated
        registry.apply_serve_flags("acme", [], [], create_tenant=True, uploader="serve --lora-modules")
    with pytest.raises(NotFound):
        registry.delete_tenant("acme")  # already deleted
    with pytest.raises(NotFound):  # nothing can be added to the tombstone
        registry.create_api_key("acme")
    with pytest.raises(NotFound):
        registry.add_version("acme", "sql", **version_fields(b"two"))
    with pytest.raises(NotFound):
        registry.update_tenant_settings("acme", {"scheduling_weight": 1})
    assert len(_rows(registry, Tenant, Tenant.name == "acme")) == 1
    assert [v.state for v in _versions_of(registry, "acme")] == [VERSION_DELETED]
    assert [k for k in _rows(registry, ApiKey, ApiKey.tenant_id == _tenant_id(registry, "acme"))] == []


def test_unknown_or_invalid_tenant_changes_nothing(registry):
    _, key = registry.create_api_key("acme")
    counter, events = registry.change_counter(), len(registry.list_audit(limit=1000))
    with pytest.raises(NotFound, match="nobody"):
        registry.delete_tenant("nobody")
    with pytest.raises(InvalidName):
        registry.delete_tenant("../acme")
    assert registry.change_counter() == counter and len(registry.list_audit(limit=1000)) == events
    assert registry.authenticate(key) == "acme" and [t.name for t in registry.list_tenants()] == ["acme", "other"]


def test_flag_keys_of_a_deleted_tenant_stay_revoked(registry):
    """A server restarted with ``--api-key K --vllm-tenant acme`` after acme was deleted: the
    tenant is not recreated and K is not brought back, under this tenant or another."""
    registry.sync_flag_keys("acme", ["flag-key-1"])
    registry.delete_tenant("acme")
    assert registry.authenticate("flag-key-1") is None
    with pytest.raises(TenantDeleted):
        registry.apply_serve_flags("acme", [], [], create_tenant=True, uploader="serve --lora-modules")
    assert registry.sync_flag_keys("acme", []).revoked == 0  # a start without keys: nothing to do
    with pytest.raises(NotFound):
        registry.sync_flag_keys("acme", ["flag-key-1"])
    with pytest.raises(Conflict, match="already a key of tenant 'acme'"):
        registry.sync_flag_keys("other", ["flag-key-1"])
    assert registry.authenticate("flag-key-1") is None


def _in_thread(fn):
    """Start ``fn`` in a thread; returns (thread, outcome dict with "value" or "error")."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_writers_waiting_on_a_tenant_delete_find_no_tenant(registry):
    """An upload and a key creation that come while a delete holds the tenant wait for it, then
    fail with NotFound: nothing live is added to the deleted tenant."""
    with registry._transaction() as session:
        tenant = repo.lock_tenant(session, "acme", exclusive=True)  # a delete in progress
        upload, uploaded = _in_thread(lambda: registry.add_version("acme", "sql", **version_fields(b"late")))
        key, keyed = _in_thread(lambda: registry.create_api_key("acme"))
        upload.join(0.5)
        key.join(0.1)
        assert upload.is_alive() and key.is_alive()  # waiting on the delete's lock
        tenant.deleted_at = utcnow()
    upload.join(15)
    key.join(15)
    assert isinstance(uploaded.get("error"), NotFound) and isinstance(keyed.get("error"), NotFound)
    assert _versions_of(registry, "acme") == []
    assert _rows(registry, ApiKey, ApiKey.tenant_id == _tenant_id(registry, "acme")) == []


def test_a_delete_waits_for_an_upload_in_progress_and_deletes_its_version(registry):
    entered, go = threading.Event(), threading.Event()

    def blob_check() -> bool:  # runs inside add_version's transaction, holding the tenant shared
        entered.set()
        return go.wait(15)

    upload, uploaded = _in_thread(
        lambda: registry.add_version("acme", "sql", check_blob=blob_check, **version_fields(b"early")))
    assert entered.wait(15)
    delete, deleted = _in_thread(lambda: registry.delete_tenant("acme"))
    delete.join(0.5)
    assert delete.is_alive()  # waits for the upload's transaction
    go.set()
    upload.join(15)
    delete.join(15)
    version, created = uploaded["value"]
    assert created and [v.sha256 for v in deleted["value"].versions] == [version.sha256]
    assert [v.state for v in _versions_of(registry, "acme")] == [VERSION_DELETED]
