"""Admin and tenant routes under hostile or mistaken input: every refusal is an OpenAI envelope
naming the right ``param``, and refusals, deletes and uploads leave no state behind."""

from __future__ import annotations

import itertools
import threading
import time

import httpx
import pytest

from tests.server.test_admin_fake import _files
from tests.server.test_errors_fake import _envelope

DEEP = "[" * 100_000 + "]" * 100_000  # deeper than Python's recursion limit
_tenant_ids = itertools.count()


def _new_tenant(srv, prefix: str) -> tuple[str, str]:
    """A fresh tenant of the module's server: (name, API key)."""
    name = f"{prefix}{next(_tenant_ids)}"
    return name, srv.make_tenant(name)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_deeply_nested_tenant_body_is_a_400(module_server, path):
    _, key = _new_tenant(module_server, "nest")
    with module_server.tenant_client(key) as t:
        r = t.post(path, content='{"model": ' + DEEP + "}", headers={"content-type": "application/json"})
    _envelope(r, 400)


def test_deeply_nested_admin_body_is_a_400(module_server):
    with module_server.admin() as c:
        r = c.post("/admin/v1/tenants", content='{"name": ' + DEEP + "}", headers={"content-type": "application/json"})
    _envelope(r, 400)


@pytest.mark.parametrize(
    "method, suffix, body",
    [
        ("PUT", "/active", {"version": "x"}),
        ("PUT", "/active", {"version": -1}),
        ("PUT", "/active", {"version": 0}),
        ("PUT", "/active", {"version": "1e0"}),
        ("DELETE", "/versions/x", None),
        ("DELETE", "/versions/0", None),
        ("POST", "/load", {"version": "../x"}),
        ("POST", "/load", {"version": [1]}),
    ],
)
def test_bad_version_names_the_version_param(module_server, method, suffix, body):
    tenant, _ = _new_tenant(module_server, "ver")
    base = f"/admin/v1/tenants/{tenant}/adapters/m"
    with module_server.admin() as c:
        for payload in (b"one", b"two"):
            assert c.post(base + "/versions", files=_files(payload)).status_code == 201
        r = c.request(method, base + suffix, json=body)
        _envelope(r, 400, param="version")
        info = c.get(base).json()
    assert info["active_version"] == 1 and [v["version"] for v in info["versions"]] == [1, 2]
    assert not {v["sha256"] for v in info["versions"]} & set(module_server.engine.loaded)


def test_delete_drops_weights_no_live_version_uses_from_the_engine(module_server):
    """A pinned adapter must not keep its device slot after its last version is deleted; weights
    another tenant still serves (same bytes, same content hash) stay where they are."""
    t1, _ = _new_tenant(module_server, "del")
    t2, _ = _new_tenant(module_server, "del")
    loaded = module_server.engine.loaded
    with module_server.admin() as c:
        shared = c.post(f"/admin/v1/tenants/{t1}/adapters/m/versions", files=_files(b"shared")).json()["sha256"]
        assert c.post(f"/admin/v1/tenants/{t2}/adapters/m/versions", files=_files(b"shared")).json()["sha256"] == shared
        own = c.post(f"/admin/v1/tenants/{t2}/adapters/m/versions", files=_files(b"own")).json()["sha256"]
        assert c.post(f"/admin/v1/tenants/{t1}/adapters/m/load", json={"tier": "device", "pin": True}).status_code == 200
        assert c.post(f"/admin/v1/tenants/{t2}/adapters/m/load", json={"version": 2, "tier": "host"}).status_code == 200
        assert loaded[shared] == ("device", True) and loaded[own] == ("host", False)

        assert c.delete(f"/admin/v1/tenants/{t1}/adapters/m").status_code == 200
        assert loaded[shared] == ("device", True)  # t2's version 1 has the same weights
        assert c.delete(f"/admin/v1/tenants/{t2}/adapters/m/versions/2").status_code == 200
        assert own not in loaded
        assert c.delete(f"/admin/v1/tenants/{t2}/adapters/m").status_code == 200
        assert shared not in loaded


def test_upload_is_staged_off_the_event_loop(module_server, monkeypatch):
    """Writing an upload to disk (a large archive decompresses for seconds) must not stall every
    other request and stream of the server."""
    from loraplex.server import uploads

    copy = uploads._copy_capped
    copying = threading.Event()

    def slow_copy(*args, **kwargs):
        copying.set()
        time.sleep(1.0)  # blocks whichever thread runs it
        return copy(*args, **kwargs)

    monkeypatch.setattr(uploads, "_copy_capped", slow_copy)
    tenant, _ = _new_tenant(module_server, "slow")
    result = {}

    def upload():
        with module_server.admin() as c:
            result["r"] = c.post(f"/admin/v1/tenants/{tenant}/adapters/m/versions", files=_files(b"big"))

    thread = threading.Thread(target=upload)
    thread.start()
    try:
        assert copying.wait(5)
        started = time.monotonic()
        health = httpx.get(module_server.url + "/health", timeout=5)
        waited = time.monotonic() - started
    finally:
        thread.join(10)
    assert health.status_code == 200 and waited < 0.5, waited
    assert result["r"].status_code == 201


def test_stale_upload_staging_is_swept_at_start(server_factory, tmp_path):
    """Uploads a crash interrupted leave their staging directories; the next start removes those
    older than an hour (younger ones may belong to another process sharing the home)."""
    import os

    staging = tmp_path / "s0" / "home" / "staging"
    old, fresh = staging / "upload-old", staging / "upload-fresh"
    for d in (old, fresh):
        (d / "adapter").mkdir(parents=True)
        (d / "adapter" / "adapter_model.safetensors").write_bytes(b"\x00" * 1024)
    two_hours_ago = time.time() - 7200
    for p in (old / "adapter" / "adapter_model.safetensors", old / "adapter", old):
        os.utime(p, (two_hours_ago, two_hours_ago))
    other = staging / "not-an-upload"
    other.mkdir()
    os.utime(other, (two_hours_ago, two_hours_ago))
    server_factory()
    assert not old.exists() and fresh.exists() and other.exists()


def test_load_racing_a_delete_leaves_nothing_pinned(module_server, monkeypatch):
    """A delete that lands while an admin load is reading the files (its own unload finding
    nothing yet) must not leave the deleted weights pinned: the load answers 404 and drops them."""
    tenant, _ = _new_tenant(module_server, "race")
    engine = module_server.engine
    load = engine.load_adapter

    async def load_while_deleted(ref, tier="device", pin=False):
        module_server.registry.delete_adapter(tenant, "m")  # the concurrent DELETE
        await load(ref, tier=tier, pin=pin)

    with module_server.admin() as c:
        sha = c.post(f"/admin/v1/tenants/{tenant}/adapters/m/versions", files=_files(b"racy")).json()["sha256"]
        monkeypatch.setattr(engine, "load_adapter", load_while_deleted)
        r = c.post(f"/admin/v1/tenants/{tenant}/adapters/m/load", json={"tier": "device", "pin": True})
    _envelope(r, 404, code="not_found")
    assert sha not in engine.loaded
    assert module_server.adapters.in_use.get(sha, 0) == 0


def test_unload_does_not_trust_stale_engine_stats(module_server, monkeypatch):
    """The engine's stats lag its commands; an unload right after a load must still drop it."""
    tenant, _ = _new_tenant(module_server, "stale")
    engine = module_server.engine
    with module_server.admin() as c:
        sha = c.post(f"/admin/v1/tenants/{tenant}/adapters/m/versions", files=_files(b"stale")).json()["sha256"]
        assert c.post(f"/admin/v1/tenants/{tenant}/adapters/m/load", json={"pin": True}).status_code == 200
        stats = engine.stats
        monkeypatch.setattr(engine, "stats", lambda: {**stats(), "lora": {"adapters": {}, "tiers": {}}})
        assert c.post(f"/admin/v1/tenants/{tenant}/adapters/m/unload").status_code == 200
    assert sha not in engine.loaded


def test_activate_cannot_reach_another_tenants_versions(module_server):
    t1, _ = _new_tenant(module_server, "iso")
    t2, _ = _new_tenant(module_server, "iso")
    with module_server.admin() as c:
        assert c.post(f"/admin/v1/tenants/{t1}/adapters/m/versions", files=_files(b"t1")).status_code == 201
        for payload in (b"t2a", b"t2b"):
            assert c.post(f"/admin/v1/tenants/{t2}/adapters/m/versions", files=_files(payload)).status_code == 201
        _envelope(c.put(f"/admin/v1/tenants/{t1}/adapters/m/active", json={"version": 2}), 404, code="not_found")
        _envelope(c.put(f"/admin/v1/tenants/{t1}/adapters/m/active", json={"version": f"{t2}/m@2"}), 400, param="version")
        assert c.get(f"/admin/v1/tenants/{t1}/adapters/m").json()["active_version"] == 1
        assert c.get(f"/admin/v1/tenants/{t2}/adapters/m").json()["active_version"] == 1
