"""Versioned adapters: upload, dedupe, resolve, hot-swap, delete, blob accounting, audit."""

from __future__ import annotations

import pytest

from loraplex.registry.errors import Conflict, InvalidName, NotFound, RegistryError
from tests.registry.helpers import version_fields


@pytest.fixture
def service(registry_service):
    registry_service.create_tenant("acme")
    registry_service.create_tenant("other")
    return registry_service


def test_versions_are_numbered_and_first_one_is_active(service):
    v1, created1 = service.add_version("acme", "sql", **version_fields(b"one"))
    v2, created2 = service.add_version("acme", "sql", **version_fields(b"two", rank=16, targets=["o_proj"]))
    assert (v1.version, created1, v2.version, created2) == (1, True, 2, True)
    assert v2.rank == 16 and v2.targets == ("o_proj",) and v2.ref == "sql@2"
    adapter = service.get_adapter("acme", "sql")
    assert adapter.active_version == 1 and adapter.active == v1
    assert [v.version for v in adapter.versions] == [1, 2]
    assert service.resolve("acme", "sql") == v1
    assert service.resolve("acme", "sql@2") == v2
    assert adapter.to_dict()["versions"][1]["targets"] == ["o_proj"]


def test_identical_bytes_return_the_existing_version(service):
    v1, _ = service.add_version("acme", "sql", **version_fields(b"one"))
    again, created = service.add_version("acme", "sql", **version_fields(b"one", uploader="someone-else"))
    assert created is False and again == v1
    assert len(service.get_adapter("acme", "sql").versions) == 1
    # the same bytes under another adapter or tenant are a new version there
    other, created_other = service.add_version("other", "sql", **version_fields(b"one"))
    assert created_other and other.version == 1 and other.tenant == "other"
    assert service.versions_using_blob(v1.blob_key) == 2


def test_activate_without_auto_activation(service):
    v1, _ = service.add_version("acme", "sql", activate_if_first=False, **version_fields(b"one"))
    assert service.get_adapter("acme", "sql").active_version is None
    with pytest.raises(NotFound, match="no active version"):
        service.resolve("acme", "sql")
    assert service.resolve("acme", "sql@1") == v1
    before = service.change_counter()
    assert service.activate("acme", "sql", 1, actor="alice") == v1
    assert service.resolve("acme", "sql") == v1
    assert service.change_counter() == before + 1


def test_hot_swap_changes_resolution_and_is_audited(service):
    service.add_version("acme", "sql", **version_fields(b"one"))
    v2, _ = service.add_version("acme", "sql", **version_fields(b"two"))
    counter = service.change_counter()
    assert service.activate("acme", "sql", "2", actor="alice") == v2
    assert service.resolve("acme", "sql").sha256 == v2.sha256
    assert service.change_counter() == counter + 1
    event = service.list_audit(tenant="acme", limit=1)[0]
    assert (event.action, event.actor, event.object_name) == ("adapter.activate", "alice", "sql")
    assert event.detail["from"] == 1 and event.detail["to"] == 2


def test_errors_for_missing_things(service):
    service.add_version("acme", "sql", **version_fields(b"one"))
    with pytest.raises(NotFound, match="tenant"):
        service.resolve("nobody", "sql")
    with pytest.raises(NotFound, match="adapter"):
        service.resolve("acme", "nope")
    with pytest.raises(NotFound, match="version 9"):
        service.resolve("acme", "sql@9")
    with pytest.raises(NotFound):
        service.activate("acme", "sql", 9)
    with pytest.raises(NotFound):  # tenants never see each other's adapters
        service.resolve("other", "sql")
    with pytest.raises(InvalidName):
        service.resolve("acme", "../sql")
    with pytest.raises(InvalidName):
        service.add_version("acme", "a/b", **version_fields(b"x"))
    with pytest.raises(NotFound):
        service.add_version("nobody", "sql", **version_fields(b"x"))
    assert service.get_adapter("acme", "nope") is None


@pytest.mark.parametrize(
    "bad",
    [{"sha256": "XYZ"}, {"sha256": "A" * 64}, {"rank": 0}, {"rank": 2.5}, {"size_bytes": -1},
     {"targets": "q_proj"}, {"targets": [1]}, {"blob_key": ""}, {"base_model": ""}],
)
def test_bad_version_metadata_is_refused(service, bad):
    with pytest.raises(RegistryError):
        service.add_version("acme", "sql", **version_fields(b"one", **bad))
    assert service.get_adapter("acme", "sql") is None


def test_delete_version_keeps_numbers_and_frees_blob(service):
    v1, _ = service.add_version("acme", "sql", **version_fields(b"one"))
    v2, _ = service.add_version("acme", "sql", **version_fields(b"two"))
    with pytest.raises(Conflict, match="active"):
        service.delete_version("acme", "sql", 1)
    counter = service.change_counter()
    [removed] = service.delete_version("acme", "sql", 2, actor="bob")
    assert removed.version == 2 and removed.deleted and removed.sha256 == v2.sha256
    assert service.change_counter() == counter + 1
    assert service.versions_using_blob(v2.blob_key) == 0
    with pytest.raises(NotFound, match="deleted"):
        service.resolve("acme", "sql@2")
    with pytest.raises(NotFound):
        service.activate("acme", "sql", 2)
    with pytest.raises(NotFound):
        service.delete_version("acme", "sql", 2)
    # re-uploading the deleted bytes makes version 3: name@2 never comes back with other meaning
    v3, created = service.add_version("acme", "sql", **version_fields(b"two"))
    assert created and v3.version == 3
    assert [v.version for v in service.get_adapter("acme", "sql").versions] == [1, 3]
    assert service.resolve("acme", "sql") == v1


def test_shared_blob_is_counted_until_its_last_user_goes(service):
    a, _ = service.add_version("acme", "one", **version_fields(b"same"))
    b, _ = service.add_version("acme", "two", **version_fields(b"same"))
    assert a.blob_key == b.blob_key and service.versions_using_blob(a.blob_key) == 2
    service.delete_adapter("acme", "one")
    assert service.versions_using_blob(a.blob_key) == 1
    service.delete_adapter("acme", "two")
    assert service.versions_using_blob(a.blob_key) == 0


def test_deleted_weights_are_those_no_live_version_has_any_more(service):
    """What another replica's watch asks (server/replica_deletes.py): of the hashes its engine
    holds, which did versions have and no live version has; a hash no version ever had (a merge
    built in memory) is not among them, nor are weights another tenant still serves."""
    shared, _ = service.add_version("acme", "one", **version_fields(b"same"))
    service.add_version("other", "one", **version_fields(b"same"))
    solo, _ = service.add_version("acme", "two", **version_fields(b"solo"))
    held = [shared.sha256, solo.sha256, "f" * 64]
    assert service.deleted_weights(held) == set() and service.deleted_weights([]) == set()
    service.delete_adapter("acme", "one")
    service.delete_adapter("acme", "two")
    assert service.deleted_weights(held) == {solo.sha256}
    service.delete_adapter("other", "one")
    assert service.deleted_weights(held) == {shared.sha256, solo.sha256}
    service.add_version("acme", "three", **version_fields(b"solo"))  # the same bytes, live again
    assert service.deleted_weights(held) == {shared.sha256}


def test_delete_adapter_removes_all_versions(service):
    service.add_version("acme", "sql", **version_fields(b"one"))
    service.add_version("acme", "sql", **version_fields(b"two"))
    service.add_version("acme", "keep", **version_fields(b"three"))
    removed = service.delete_adapter("acme", "sql", actor="carol")
    assert sorted(v.version for v in removed) == [1, 2] and all(v.deleted for v in removed)
    assert service.get_adapter("acme", "sql") is None
    assert [a.name for a in service.list_adapters("acme")] == ["keep"]
    with pytest.raises(NotFound):
        service.resolve("acme", "sql@1")
    with pytest.raises(NotFound):
        service.delete_adapter("acme", "sql")
    # the name can be used again; numbering continues
    again, _ = service.add_version("acme", "sql", **version_fields(b"four"))
    assert again.version == 3 and service.resolve("acme", "sql") == again


def test_list_adapters_is_per_tenant(service):
    service.add_version("acme", "b", **version_fields(b"1"))
    service.add_version("acme", "a", **version_fields(b"2"))
    service.add_version("acme", "a", **version_fields(b"3"))
    service.add_version("other", "c", **version_fields(b"4"))
    listed = service.list_adapters("acme")
    assert [(a.name, a.active_version, len(a.versions)) for a in listed] == [("a", 1, 2), ("b", 1, 1)]
    assert [a.name for a in service.list_adapters("other")] == ["c"]
    with pytest.raises(NotFound):
        service.list_adapters("nobody")


def test_every_change_is_audited(service):
    service.add_version("acme", "sql", **version_fields(b"one", uploader="up"))
    service.add_version("acme", "sql", **version_fields(b"two", uploader="up"))
    service.activate("acme", "sql", 2, actor="sw")
    service.delete_version("acme", "sql", 1, actor="del")
    service.record_event("engine", "adapter.load", "acme", "adapter", "sql@2", {"tier": "device"})
    service.delete_adapter("acme", "sql", actor="del")
    actions = [(e.action, e.actor, e.object_name) for e in reversed(service.list_audit(tenant="acme"))]
    assert actions == [
        ("tenant.create", "admin", "acme"),
        ("adapter.create", "up", "sql"),
        ("adapter.upload", "up", "sql@1"),
        ("adapter.activate", "up", "sql"),
        ("adapter.upload", "up", "sql@2"),
        ("adapter.activate", "sw", "sql"),
        ("adapter.version.delete", "del", "sql@1"),
        ("adapter.load", "engine", "sql@2"),
        ("adapter.delete", "del", "sql"),
    ]
    assert service.list_audit(tenant="acme", limit=2)[0].action == "adapter.delete"
    assert all(e.tenant == "other" for e in service.list_audit(tenant="other"))
    assert len(service.list_audit()) == len(actions) + 1  # plus other's tenant.create


def test_failed_change_leaves_no_trace(service):
    service.add_version("acme", "sql", **version_fields(b"one"))
    counter, events = service.change_counter(), len(service.list_audit())
    with pytest.raises(Conflict):
        service.delete_version("acme", "sql", 1)
    with pytest.raises(NotFound):
        service.activate("acme", "sql", 5)
    assert service.change_counter() == counter and len(service.list_audit()) == events


def test_a_failure_inside_an_upload_leaves_no_version(service, monkeypatch):
    from loraplex.registry import repository

    real = repository.add_audit_event

    def failing_audit(session, **kwargs):
        if kwargs["action"] == "adapter.upload":
            raise RuntimeError("crash after the version row was written")
        return real(session, **kwargs)

    monkeypatch.setattr(repository, "add_audit_event", failing_audit)
    with pytest.raises(RuntimeError):
        service.add_version("acme", "sql", **version_fields(b"one"))
    monkeypatch.setattr(repository, "add_audit_event", real)
    assert service.get_adapter("acme", "sql") is None
    assert service.versions_using_blob(version_fields(b"one")["blob_key"]) == 0
    version, created = service.add_version("acme", "sql", **version_fields(b"one"))
    assert created and version.version == 1


def test_a_failure_inside_a_hot_swap_changes_nothing(service, monkeypatch):
    from loraplex.registry import repository

    service.add_version("acme", "sql", **version_fields(b"one"))
    service.add_version("acme", "sql", **version_fields(b"two"))
    counter = service.change_counter()

    def failing_bump(session):
        raise RuntimeError("crash after active_version was updated")

    monkeypatch.setattr(repository, "bump_change_counter", failing_bump)
    with pytest.raises(RuntimeError):
        service.activate("acme", "sql", 2)
    assert service.resolve("acme", "sql").version == 1
    assert service.change_counter() == counter
