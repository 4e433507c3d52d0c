"""``loraplex tenants delete NAME [--yes]`` through ``loraplex.cli.main`` on a temp home, checked
against the registry database and the blob directory."""

from __future__ import annotations

from loraplex.config import Settings
from loraplex.lora.peft_format import compute_content_hash
from loraplex.registry.service import RegistryService
from loraplex.storage.base import content_key, open_blob_store
from tests.registry.test_cli import home, run, setup  # noqa: F401 - fixtures

__all__ = ["home", "setup"]


def test_tenants_delete_needs_yes_then_offboards(home, setup, capsys):
    a, b = setup["adapters"]["a"], setup["adapters"]["b"]
    for argv in (["tenants", "create", "acme"], ["tenants", "create", "other"],
                 ["adapters", "upload", "--tenant", "acme", "--name", "mine", str(a)],
                 ["adapters", "upload", "--tenant", "acme", "--name", "shared", str(b)],
                 ["adapters", "upload", "--tenant", "other", "--name", "theirs", str(b)]):
        assert run(capsys, *argv)[0] == 0, argv
    registry = RegistryService.from_url(Settings().resolved_database_url())
    _, secret = registry.create_api_key("acme")
    blobs = open_blob_store(str(home / "blobs"))
    key_a, key_b = content_key(compute_content_hash(a)), content_key(compute_content_hash(b))

    code, out, err = run(capsys, "tenants", "delete", "acme")  # no --yes: says what would go, changes nothing
    assert code == 1 and out == ""
    assert "revokes 1 API key(s) and deletes 2 adapter(s) (2 version(s))" in err and "--yes" in err
    assert registry.authenticate(secret) == "acme" and blobs.exists(key_a)

    code, out, err = run(capsys, "tenants", "delete", "acme", "--yes")
    assert code == 0 and "deleted tenant acme: 1 API key(s) revoked, 2 adapter(s) and 2 version(s) deleted" in out
    assert registry.authenticate(secret) is None and registry.get_tenant("acme") is None
    assert not blobs.exists(key_a) and blobs.exists(key_b)  # b is other's too
    assert [(a.name, a.active_version) for a in registry.list_adapters("other")] == [("theirs", 1)]
    assert run(capsys, "tenants", "list")[1].split()[0] == "other"
    assert [e.detail for e in registry.list_audit("acme") if e.action == "tenant.delete"] == [
        {"api_keys_revoked": 1, "adapters_deleted": 2, "versions_deleted": 2}]

    for argv, message in ((["tenants", "delete", "acme", "--yes"], "not found"),
                          (["tenants", "delete", "nobody"], "not found"),
                          (["tenants", "delete", "../evil", "--yes"], "tenant"),
                          (["tenants", "create", "acme"], "never reused")):
        code, out, err = run(capsys, *argv)
        assert code == 1 and err.startswith("error: ") and message in err, (argv, err)
    assert [t.name for t in registry.list_tenants()] == ["other"]
