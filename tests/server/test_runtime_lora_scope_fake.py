"""What vLLM's runtime LoRA endpoints may change: only adapters ``/v1/load_lora_adapter`` created.

An adapter the operator manages (uploaded through the admin API, registered by
``--lora-modules``) is refused to a tenant key, ordinary or ``--api-key``, for unload and for a
load in place, with a 403 in the OpenAI error shape; the registry (adapter, versions, audit) and
the blob store are checked unchanged after each refusal. Over the fake engine, with the real
AdapterManager and a real SQLite registry."""

from __future__ import annotations

import httpx
import pytest

from loraplex.lora.peft_format import CONFIG_NAME, WEIGHTS_NAME, compute_content_hash
from loraplex.server.vllm_startup import MODULES_ACTOR
from loraplex.storage.base import open_blob_store
from tests.fixtures.peft_adapters import make_peft_adapter, tiny_llama
from tests.registry.adapter_manager_helpers import build_adapters, make_manager
from tests.server.conftest import start_server
from tests.server.fakes import FakeEngine

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
REFUSED_CODE = "adapter_managed_by_operator"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """``(root, dirs)``: adapters a, b and c under ``root``, the allowed root."""
    root = tmp_path_factory.mktemp("lora-root")
    _, dirs = build_adapters(root)
    c = make_peft_adapter(tiny_llama(seed=11), root / "c", seed=21)
    return root, {**dirs, "c": c}


@pytest.fixture(scope="module")
def srv(tmp_path_factory, adapters):
    root, _ = adapters
    spec, _ = build_adapters(tmp_path_factory.mktemp("spec-only"))

    def make(registry, home):
        return make_manager(registry, open_blob_store(str(home / "blobs")), home / "cache", spec)

    server = start_server(tmp_path_factory.mktemp("runtime-scope"), FakeEngine(step_seconds=0.01), make,
                          allow_runtime_lora_updating=True, lora_path_roots=[root])
    yield server
    server.stop()


_tenants = iter(range(1000))


@pytest.fixture
def tenant(srv) -> tuple[str, httpx.Client]:
    name = f"scope{next(_tenants)}"
    client = srv.tenant_client(srv.make_tenant(name))
    yield name, client
    client.close()


def admin_upload(srv, tenant: str, name: str, path) -> httpx.Response:
    files = {n: (n, (path / n).read_bytes(), "application/octet-stream") for n in (CONFIG_NAME, WEIGHTS_NAME)}
    with srv.admin() as admin:
        return admin.post(f"/admin/v1/tenants/{tenant}/adapters/{name}/versions", files=files)


def snapshot(srv, tenant: str) -> tuple:
    """Everything a refused call must leave as it was: the tenant's adapters with their versions
    and origin, its audit trail, and the blob store's keys."""
    return (srv.registry.list_adapters(tenant), srv.registry.list_audit(tenant, limit=1000),
            sorted(b.key for b in srv.adapters.blobs.list_blobs("sha256/")))


def assert_refused(r: httpx.Response, name: str) -> None:
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert error["code"] == REFUSED_CODE and error["param"] == "lora_name" and error["type"] == "permission_error"
    assert f"'{name}'" in error["message"] and "admin API" in error["message"]


def test_an_admin_uploaded_adapter_cannot_be_unloaded_or_replaced_by_a_tenant_key(srv, adapters, tenant):
    name, client = tenant
    _, dirs = adapters
    assert admin_upload(srv, name, "sql", dirs["a"]).status_code == 201
    flag_key = "sk-flag-" + name  # the --api-key of a vLLM tenant is a key of the tenant too
    srv.registry.sync_flag_keys(name, [flag_key])
    before = snapshot(srv, name)
    with srv.tenant_client(flag_key) as flag_client:
        for c in (client, flag_client):
            assert_refused(c.post(UNLOAD, json={"lora_name": "sql"}), "sql")
            assert_refused(c.post(f"/t/{name}/v1/unload_lora_adapter", json={"lora_name": "sql"}), "sql")
            assert_refused(c.post(LOAD, json={"lora_name": "sql", "lora_path": str(dirs["b"]),
                                               "load_inplace": True}), "sql")
            again = c.post(LOAD, json={"lora_name": "sql", "lora_path": str(dirs["b"])})  # vLLM's answer
            assert again.status_code == 400 and again.json()["error"]["message"] == (
                "The lora adapter 'sql' has already been loaded.")
    assert snapshot(srv, name) == before
    assert srv.registry.resolve(name, "sql").sha256 == compute_content_hash(dirs["a"])


def test_a_lora_modules_adapter_cannot_be_unloaded_by_a_tenant_key(srv, adapters, tenant):
    name, client = tenant
    _, dirs = adapters
    srv.adapters.upload_all_active(name, [("chat", dirs["b"])], MODULES_ACTOR)  # what serve --lora-modules does
    before = snapshot(srv, name)
    assert_refused(client.post(UNLOAD, json={"lora_name": "chat"}), "chat")
    assert snapshot(srv, name) == before
    chat = client.post("/v1/chat/completions", json={"model": "chat", "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200, chat.text


def test_a_runtime_loaded_adapter_stays_the_tenants_until_the_operator_uploads_to_it(srv, adapters, tenant):
    name, client = tenant
    _, dirs = adapters
    assert client.post(LOAD, json={"lora_name": "sql", "lora_path": str(dirs["a"])}).status_code == 200
    inplace = client.post(LOAD, json={"lora_name": "sql", "lora_path": str(dirs["c"]), "load_inplace": True})
    assert inplace.status_code == 200  # its own adapter: a new version over it
    with srv.admin() as admin:
        shown = admin.get(f"/admin/v1/tenants/{name}/adapters/sql").json()
    assert shown["origin"] == "runtime_load" and shown["active_version"] == 2
    assert admin_upload(srv, name, "sql", dirs["b"]).status_code == 201  # the operator takes it over
    with srv.admin() as admin:
        assert admin.get(f"/admin/v1/tenants/{name}/adapters/sql").json()["origin"] is None
    before = snapshot(srv, name)
    assert_refused(client.post(UNLOAD, json={"lora_name": "sql"}), "sql")
    assert snapshot(srv, name) == before


def test_a_name_the_operator_deleted_can_be_loaded_and_unloaded_at_runtime(srv, adapters, tenant):
    name, client = tenant
    _, dirs = adapters
    assert admin_upload(srv, name, "sql", dirs["a"]).status_code == 201
    with srv.admin() as admin:
        assert admin.delete(f"/admin/v1/tenants/{name}/adapters/sql").status_code in (200, 204)
    assert client.post(LOAD, json={"lora_name": "sql", "lora_path": str(dirs["b"])}).status_code == 200
    assert srv.registry.get_adapter(name, "sql").versions[-1].version == 2  # numbering continues
    r = client.post(UNLOAD, json={"lora_name": "sql"})
    assert r.status_code == 200 and srv.registry.get_adapter(name, "sql") is None


def test_an_operator_upload_landing_during_a_runtime_load_in_place_leaves_no_refused_version(
        srv, adapters, tenant, monkeypatch):
    """The runtime load's version is written, then the operator uploads to the name (taking the
    adapter over) before the load makes its version active. Whichever way the two are ordered,
    the answer must agree with the registry: a 403 ("managed by the operator") leaves no version
    of the refused weights behind; a 200 means they were loaded (the operator's came after)."""
    name, client = tenant
    _, dirs = adapters
    assert client.post(LOAD, json={"lora_name": "sql", "lora_path": str(dirs["a"])}).status_code == 200
    registry = srv.adapters.registry
    original, fired = registry.add_version, []

    def operator_upload_right_after_the_runtime_write(*args, **kwargs):
        out = original(*args, **kwargs)
        if kwargs.get("origin") == "runtime_load" and not fired:
            fired.append(True)
            srv.adapters.upload_active(name, "sql", dirs["b"])  # the operator's, as the admin API does
        return out

    monkeypatch.setattr(registry, "add_version", operator_upload_right_after_the_runtime_write)
    r = client.post(LOAD, json={"lora_name": "sql", "lora_path": str(dirs["c"]), "load_inplace": True})
    assert fired
    adapter = srv.registry.get_adapter(name, "sql")
    shas = [v.sha256 for v in adapter.versions]
    assert r.status_code in (200, 403), r.text
    if r.status_code == 403:
        assert compute_content_hash(dirs["c"]) not in shas  # refused: nothing of it written
    else:
        assert compute_content_hash(dirs["c"]) in shas
    assert adapter.origin is None  # the operator's upload came last either way, and took it over
    assert srv.registry.resolve(name, "sql").sha256 == compute_content_hash(dirs["b"])
