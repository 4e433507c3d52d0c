"""vLLM-style ``--api-key`` keys over HTTP (fake engine, real SQLite registry): they authenticate on
their tenant's ``/v1`` routes like any tenant key, and rotating the flag locks the old key out
while a key made through the admin API keeps working."""

from __future__ import annotations

import time

import httpx

from loraplex.server.vllm_flags import StartupFlags
from loraplex.server.vllm_startup import apply_startup_flags

KEY = "sk-vllm-team-key"


def _rotate(srv, *keys: str):
    return apply_startup_flags(StartupFlags(api_keys=keys), srv.app.state.ctx.settings, srv.registry)


def _wait_for_status(client: httpx.Client, path: str, status: int) -> int:
    """A key revoked elsewhere is seen once the auth cache (``registry_poll_seconds``) expires."""
    deadline = time.monotonic() + 5
    while (got := client.get(path).status_code) != status and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def test_a_vllm_style_key_calls_its_tenants_models_and_chat(fake_server):
    _rotate(fake_server, KEY)
    version = fake_server.upload("default", "sql", payload=b"sql weights")
    fake_server.make_tenant("other")
    fake_server.upload("other", "private")
    with fake_server.tenant_client(KEY) as c:
        models = c.get("/v1/models")
        assert models.status_code == 200
        assert [m["id"] for m in models.json()["data"]][1:] == ["sql"]  # the base model, then its adapters
        chat = c.post("/v1/chat/completions",
                      json={"model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert chat.status_code == 200 and chat.json()["model"] == "sql"
        assert fake_server.engine.started[-1][1] == version["sha256"]
        assert c.get("/t/default/v1/models").status_code == 200
        assert c.get("/t/other/v1/models").status_code == 401  # not the other tenant's key
        private = c.post("/v1/chat/completions",
                         json={"model": "private", "messages": [{"role": "user", "content": "hi"}]})
        assert private.status_code == 404 and private.json()["error"]["code"] == "model_not_found"


def test_rotating_the_flag_revokes_the_old_key_not_an_admin_made_one(fake_server):
    _rotate(fake_server, KEY)
    with fake_server.admin() as admin:
        made = admin.post("/admin/v1/tenants/default/keys").json()
    with fake_server.tenant_client(KEY) as old, fake_server.tenant_client("sk-next") as new, \
            fake_server.tenant_client(made["key"]) as by_admin:
        assert old.get("/v1/models").status_code == 200
        assert new.get("/v1/models").status_code == 401
        outcome = _rotate(fake_server, "sk-next")  # the next start's command line
        assert (outcome.keys_added, outcome.keys_revoked) == (1, 1)
        assert _wait_for_status(old, "/v1/models", 401) == 401
        assert new.get("/v1/models").status_code == 200
        assert by_admin.get("/v1/models").status_code == 200
    with fake_server.admin() as admin:
        keys = admin.get("/admin/v1/tenants/default/keys").json()["data"]
    # by id: the first flag key (revoked), the admin's, the rotated-in flag key
    assert [(k["origin"], k["revoked_at"] is None) for k in keys] == [
        ("serve_flag", False), (None, True), ("serve_flag", True)]
    assert KEY not in str(keys) and "sk-next" not in str(keys)
