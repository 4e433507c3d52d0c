"""Admin API routes over a fake engine and a real SQLite registry."""

from __future__ import annotations

import io
import tarfile

import httpx
import pytest

import loraplex


def _files(payload: bytes) -> dict:
    return {
        "adapter_config.json": ("adapter_config.json", io.BytesIO(b"{}"), "application/json"),
        "adapter_model.safetensors": ("adapter_model.safetensors", io.BytesIO(payload), "application/octet-stream"),
    }


def _targz(payload: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in (("my-adapter/adapter_config.json", b"{}"), ("my-adapter/adapter_model.safetensors", payload)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_admin_key_required(fake_server):
    with httpx.Client(base_url=fake_server.url) as c:
        for method, path in [("GET", "/admin/v1/tenants"), ("POST", "/admin/v1/tenants"), ("GET", "/admin/v1/status"),
                             ("GET", "/admin/v1/audit"), ("GET", "/admin/v1/tenants/x/adapters")]:
            r = c.request(method, path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = c.request(method, path, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401


def test_tenants_and_keys(fake_server):
    with fake_server.admin() as c:
        r = c.post("/admin/v1/tenants", json={"name": "acme"})
        assert r.status_code == 201 and r.json()["name"] == "acme"
        assert c.post("/admin/v1/tenants", json={"name": "acme"}).status_code == 409
        bad = c.post("/admin/v1/tenants", json={"name": "../etc"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "name"
        # settings go through PATCH: here they were dropped without a word
        extra = c.post("/admin/v1/tenants", json={"name": "beta", "max_concurrent_requests": 8})
        assert extra.status_code == 400 and extra.json()["error"]["param"] == "max_concurrent_requests"
        assert [t["name"] for t in c.get("/admin/v1/tenants").json()["data"]] == ["acme"]
        created = c.post("/admin/v1/tenants/acme/keys")
        assert created.status_code == 201
        key = created.json()["key"]
        listed = c.get("/admin/v1/tenants/acme/keys").json()["data"]
        assert len(listed) == 1 and key not in str(listed)  # shown once, never again
        assert c.post("/admin/v1/tenants/nobody/keys").status_code == 404
    with fake_server.tenant_client(key) as t:
        assert t.get("/v1/models").status_code == 200
    with fake_server.admin() as c:
        assert c.delete(f"/admin/v1/tenants/acme/keys/{created.json()['id']}").status_code == 200
    with fake_server.tenant_client(key) as t:
        assert t.get("/v1/models").status_code == 401  # revoked: effective at once


def test_adapter_lifecycle(fake_server):
    fake_server.make_tenant("acme")
    with fake_server.admin() as c:
        base = "/admin/v1/tenants/acme/adapters/sql"
        v1 = c.post(base + "/versions", files=_files(b"one"))
        assert v1.status_code == 201 and v1.json()["version"] == 1 and v1.json()["created"] is True
        again = c.post(base + "/versions", files=_files(b"one"))
        assert again.status_code == 200 and again.json()["version"] == 1 and again.json()["created"] is False
        v2 = c.post(base + "/versions", files={"archive": ("a.tar.gz", io.BytesIO(_targz(b"two")), "application/gzip")})
        assert v2.status_code == 201 and v2.json()["version"] == 2
        missing = c.post(base + "/versions", files={"other": ("x", io.BytesIO(b"x"))})
        assert missing.status_code == 400
        assert c.post("/admin/v1/tenants/nobody/adapters/x/versions", files=_files(b"z")).status_code == 404

        info = c.get(base).json()
        assert info["active_version"] == 1 and [v["version"] for v in info["versions"]] == [1, 2]
        assert info["tier"] == "store" and info["versions"][0]["sha256"] == v1.json()["sha256"]
        assert c.put(base + "/active", json={"version": 2}).json()["version"] == 2
        assert c.get(base).json()["active_version"] == 2
        assert c.put(base + "/active", json={"version": 7}).status_code == 404

        loaded = c.post(base + "/load", json={"tier": "device", "pin": True})
        assert loaded.status_code == 200 and fake_server.engine.loaded[v2.json()["sha256"]] == ("device", True)
        assert c.get(base).json()["tier"] == "device"
        assert c.post(base + "/load", json={"tier": "moon"}).json()["error"]["param"] == "tier"
        # a misspelt option is named, not left out (an operator asking to pin got an unpinned load)
        audit = c.get("/admin/v1/audit", params={"tenant": "acme"}).json()["data"]
        for path, method, body, field in (("/load", "post", {"tier": "host", "pinned": True}, "pinned"),
                                          ("/active", "put", {"version": 1, "force": True}, "force")):
            refused = getattr(c, method)(base + path, json=body)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
        assert c.get("/admin/v1/audit", params={"tenant": "acme"}).json()["data"] == audit  # nothing changed
        assert c.get(base).json()["active_version"] == 2
        assert c.post(base + "/unload").status_code == 200 and not fake_server.engine.loaded

        assert c.delete(base + "/versions/2").status_code == 409  # the active one
        assert c.delete(base + "/versions/1").status_code == 200
        assert [v["version"] for v in c.get(base).json()["versions"]] == [2]
        assert c.delete(base).status_code == 200
        assert c.get(base).status_code == 404
        assert c.get("/admin/v1/tenants/acme/adapters").json()["data"] == []

        actions = [e["action"] for e in c.get("/admin/v1/audit", params={"tenant": "acme"}).json()["data"]]
        for action in ("adapter.upload", "adapter.activate", "adapter.load", "adapter.unload", "adapter.delete"):
            assert action in actions
        assert c.get("/admin/v1/audit", params={"limit": "0"}).status_code == 400


def test_status_health_ready_metrics(fake_server):
    key = fake_server.make_tenant("acme")
    with fake_server.tenant_client(key) as t:
        assert t.post("/v1/completions", json={"model": "fake-model", "prompt": "abc", "max_tokens": 3}).status_code == 200
    with httpx.Client(base_url=fake_server.url) as c:
        assert c.get("/health").json() == {"status": "ok"}
        assert c.get("/version").json() == {"version": loraplex.__version__}
        assert c.get("/ready").status_code == 200
        text = c.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:lora_requests_info", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "loraplex_adapters", "loraplex_adapter_loads_total", "loraplex_adapter_evictions_total",
                 "loraplex_adapter_load_seconds_total"):
        assert name in text, name
    assert 'vllm:prompt_tokens_total{model_name="fake-model"} 4.0' in text
    assert 'vllm:generation_tokens_total{model_name="fake-model"} 3.0' in text
    assert 'loraplex_adapter_requests_total{adapter="base"} 1.0' in text
    assert 'max_lora="8"' in text
    with fake_server.admin() as c:
        status = c.get("/admin/v1/status").json()
    assert status["ready"] is True and status["model"] == "fake-model"
    assert status["num_requests_running"] == 0


def test_adapter_label_set_is_bounded():
    from loraplex.server.metrics import OTHER_LABEL, ServerMetrics

    m = ServerMetrics("m", 4, max_adapter_labels=3)
    labels = {m.adapter_label(f"t/a{i}") for i in range(10)}
    assert labels == {"t/a0", "t/a1", "t/a2", OTHER_LABEL}
    assert m.adapter_label("t/a1") == "t/a1"


@pytest.mark.parametrize("path", ["/admin/", "/admin/index.html"])
def test_admin_ui_served(fake_server, path):
    r = httpx.get(fake_server.url + path)
    assert r.status_code == 200 and "<html" in r.text.lower()


def test_access_log_lines_and_http_counter(fake_server, caplog):
    import json
    import logging

    key = fake_server.make_tenant("logs")
    with caplog.at_level(logging.INFO, logger="loraplex.access"), fake_server.tenant_client(key) as t:
        assert t.post("/v1/completions", json={"model": "fake-model", "prompt": "ab", "max_tokens": 2}).status_code == 200
        assert t.post("/v1/completions", json={"model": "missing", "prompt": "ab"}).status_code == 404
        assert httpx.post(fake_server.url + "/v1/completions", json={}).status_code == 401
    records = [json.loads(r.getMessage()) for r in caplog.records if r.name == "loraplex.access"]
    assert [r["status"] for r in records] == [200, 404, 401]
    assert records[0]["tenant"] == "logs" and records[0]["completion_tokens"] == 2 and records[0]["ttft_s"] is not None
    assert records[1]["tenant"] == "logs" and records[2]["tenant"] is None
    assert key not in caplog.text
    text = httpx.get(fake_server.url + "/metrics").text
    assert 'loraplex_http_requests_total{route="completions",status="404"} 1.0' in text


def test_ready_reflects_engine_and_registry(fake_server, monkeypatch):
    url = fake_server.url + "/ready"
    assert httpx.get(url).status_code == 200
    fake_server.engine.is_running = False
    r = httpx.get(url)
    assert r.status_code == 503 and "engine stopped" in r.json()["reasons"]
    fake_server.engine.is_running = True
    monkeypatch.setattr(fake_server.registry, "ping", lambda: False)
    r = httpx.get(url)
    assert r.status_code == 503 and "registry unreachable" in r.json()["reasons"]
    assert httpx.get(fake_server.url + "/health").status_code == 200  # alive all along
