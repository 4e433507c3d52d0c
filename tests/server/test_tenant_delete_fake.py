"""``DELETE /admin/v1/tenants/{t}`` through the HTTP server (fake engine, real registry, real
adapter manager on a local blob store), checked against the HTTP contract, the blob store's
files and the engine's loaded adapters: the tenant's key gets 401 at once, its adapters leave
the admin listings, a request in flight finishes normally (and is billed), weights only it used
leave the engine and their blob goes after that request, the other tenant is untouched."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from loraplex.registry.adapter_manager import AdapterManager
from loraplex.storage.base import open_blob_store
from tests.registry.adapter_manager_helpers import MAX_RANK, build_adapters
from tests.server.conftest import start_server
from tests.server.fakes import FakeEngine

MAX_TOKENS = 20


@pytest.fixture(scope="module")
def peft(tmp_path_factory):
    return build_adapters(tmp_path_factory.mktemp("peft"))


@pytest.fixture
def server(tmp_path, peft):
    spec, _ = peft
    blobs = open_blob_store(str(tmp_path / "blobs"))

    def make_adapters(registry, home):
        cache = AdapterManager.make_disk_cache(home / "adapter-cache", 1 << 30)
        return AdapterManager(registry, blobs, cache, spec, MAX_RANK, background_deletes=True)

    srv = start_server(tmp_path, FakeEngine(step_seconds=0.1), make_adapters)
    yield srv, blobs
    srv.stop()


def _chat(client: httpx.Client, tenant: str, model: str) -> httpx.Response:
    return client.post(f"/t/{tenant}/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_TOKENS})


def _wait(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_delete_tenant_over_http(server, peft):
    srv, blobs = server
    _, dirs = peft
    acme_key, other_key = srv.make_tenant("acme"), srv.make_tenant("other")
    own, _ = srv.adapters.upload("acme", "own", dirs["b"], "admin")
    shared, _ = srv.adapters.upload("acme", "shared", dirs["a"], "admin")
    theirs, _ = srv.adapters.upload("other", "theirs", dirs["a"], "admin")  # same blob as acme/shared
    with srv.admin() as admin:
        for name in ("own", "shared"):
            assert admin.post(f"/admin/v1/tenants/acme/adapters/{name}/load", json={"tier": "device"}).status_code == 200
        assert set(srv.engine.loaded) == {own.sha256, shared.sha256}

        in_flight: dict = {}

        def run() -> None:
            with srv.tenant_client(acme_key) as c:
                in_flight["response"] = _chat(c, "acme", "own")

        thread = threading.Thread(target=run)
        thread.start()
        assert _wait(lambda: any(h == own.sha256 for _, h in srv.engine.started))

        r = admin.delete("/admin/v1/tenants/acme")
        assert r.status_code == 200, r.text
        assert thread.is_alive() and blobs.exists(own.blob_key)  # still running on acme/own
        assert r.json() == {"name": "acme", "deleted": True, "api_keys_revoked": 1, "adapters_deleted": 2,
                            "versions_deleted": 2, "adapters": ["own", "shared"]}

        with srv.tenant_client(acme_key) as c:  # at once on this replica: no cache grace
            assert c.get("/v1/models").status_code == 401
            assert _chat(c, "acme", "shared").status_code == 401
        assert "acme" not in [t["name"] for t in admin.get("/admin/v1/tenants").json()["data"]]
        for path in ("/admin/v1/tenants/acme", "/admin/v1/tenants/acme/adapters",
                     "/admin/v1/tenants/acme/adapters/own"):
            assert admin.get(path).status_code == 404, path
        # weights only acme used left the engine; the ones other still uses stayed
        assert srv.engine.loaded.keys() == {shared.sha256}

        thread.join(10)
        answer = in_flight["response"]
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == MAX_TOKENS
        assert answer.json()["choices"][0]["finish_reason"] == "length"
        # the unshared blob goes once that request released it; the shared one stays
        assert _wait(lambda: not blobs.exists(own.blob_key))
        assert blobs.exists(shared.blob_key)

        # the other tenant is untouched
        with srv.tenant_client(other_key) as c:
            assert _chat(c, "other", "theirs").status_code == 200
        listed = admin.get("/admin/v1/tenants/other/adapters").json()["data"]
        assert [(a["name"], a["active_version"]) for a in listed] == [("theirs", theirs.version)]

        # audit and billing: the delete is audited with counts; acme's usage is kept
        events = admin.get("/admin/v1/audit", params={"tenant": "acme"}).json()["data"]
        delete_event = next(e for e in events if e["action"] == "tenant.delete")
        assert delete_event["detail"] == {"api_keys_revoked": 1, "adapters_deleted": 2, "versions_deleted": 2}
        usage = admin.get("/admin/v1/tenants/acme/usage").json()
        assert usage["totals"]["requests"] == 1 and usage["totals"]["completion_tokens"] == MAX_TOKENS


def test_delete_refusals_change_nothing(fake_server):
    key = fake_server.make_tenant("acme")
    with fake_server.admin() as admin:
        r = admin.delete("/admin/v1/tenants/nobody")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = admin.delete("/admin/v1/tenants/bad%20name!")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_name"
        with fake_server.tenant_client(key) as c:  # a tenant key is not an admin key
            assert c.delete("/admin/v1/tenants/acme").status_code == 401
        assert [t["name"] for t in admin.get("/admin/v1/tenants").json()["data"]] == ["acme"]
        with fake_server.tenant_client(key) as c:
            assert c.get("/v1/models").status_code == 200

        assert admin.delete("/admin/v1/tenants/acme").status_code == 200
        assert admin.delete("/admin/v1/tenants/acme").status_code == 404  # already deleted
        r = admin.post("/admin/v1/tenants", json={"name": "acme"})  # names are never reused
        assert r.status_code == 409 and r.json()["error"]["code"] == "tenant_deleted"
        assert admin.get("/admin/v1/tenants").json()["data"] == []
