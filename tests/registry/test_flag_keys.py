"""Keys from ``loraplex serve --api-key`` (vLLM's flag): stored hashed in a tenant, marked as the
flag's, kept in step with the command line; on SQLite and PostgreSQL, checked in the database."""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import select

from loraplex.registry import db
from loraplex.registry.errors import Conflict, InvalidName, NotFound
from loraplex.registry.models import ApiKey

VLLM_KEY = "sk-team-sql-2026"  # a vLLM-style key: not loraplex's lpx_ format


def _rows(registry_service) -> list[ApiKey]:
    with registry_service._session_factory() as session:
        return list(session.scalars(select(ApiKey).order_by(ApiKey.id)))


def test_a_vllm_style_key_is_stored_hashed_and_authenticates(registry_service):
    registry_service.create_tenant("default")
    sync = registry_service.sync_flag_keys("default", [VLLM_KEY, "second-key"])
    assert (sync.added, sync.kept, sync.revoked) == (2, 0, 0)
    assert registry_service.authenticate(VLLM_KEY) == "default"
    assert registry_service.authenticate("second-key") == "default"
    assert registry_service.authenticate(VLLM_KEY + "x") is None
    rows = _rows(registry_service)
    assert [r.secret_sha256 for r in rows] == [hashlib.sha256(k.encode()).hexdigest() for k in (VLLM_KEY, "second-key")]
    assert {r.origin for r in rows} == {"serve_flag"}
    # a chosen key may be short: the display prefix must not hold any of it
    assert all("sk-" not in r.prefix and "second" not in r.prefix for r in rows)
    listed = registry_service.list_api_keys("default")
    assert [k.origin for k in listed] == ["serve_flag", "serve_flag"]
    audit = [e for e in registry_service.list_audit("default") if e.action == "api_key.create"]
    assert len(audit) == 2 and VLLM_KEY not in repr(audit)


def test_a_restart_with_the_same_keys_changes_nothing(registry_service):
    registry_service.create_tenant("default")
    registry_service.sync_flag_keys("default", [VLLM_KEY])
    again = registry_service.sync_flag_keys("default", [VLLM_KEY, VLLM_KEY])  # listed twice: one key
    assert (again.added, again.kept, again.revoked) == (0, 1, 0)
    assert len(_rows(registry_service)) == 1


def test_rotating_the_flag_revokes_the_old_flag_key_but_no_admin_key(registry_service):
    registry_service.create_tenant("default")
    admin_info, admin_secret = registry_service.create_api_key("default")
    registry_service.sync_flag_keys("default", ["old-key"])
    rotated = registry_service.sync_flag_keys("default", ["new-key"])
    assert (rotated.added, rotated.kept, rotated.revoked) == (1, 0, 1)
    assert registry_service.authenticate("old-key") is None
    assert registry_service.authenticate("new-key") == "default"
    assert registry_service.authenticate(admin_secret) == "default"
    by_origin = {(k.origin, k.revoked) for k in registry_service.list_api_keys("default")}
    assert by_origin == {(None, False), ("serve_flag", True), ("serve_flag", False)}
    # the flag left out entirely: its keys go too, the admin's stays
    assert registry_service.sync_flag_keys("default", []).revoked == 1
    assert registry_service.authenticate("new-key") is None
    assert registry_service.authenticate(admin_secret) == "default"


def test_an_admin_key_given_as_flag_stays_the_admins(registry_service):
    registry_service.create_tenant("default")
    _, secret = registry_service.create_api_key("default")
    assert registry_service.sync_flag_keys("default", [secret]).kept == 1
    registry_service.sync_flag_keys("default", [])
    assert registry_service.authenticate(secret) == "default"  # never revoked by start-up
    assert [r.origin for r in _rows(registry_service)] == [None]


def test_a_key_of_another_tenant_or_a_revoked_key_is_refused_and_nothing_changes(registry_service):
    for name in ("default", "other"):
        registry_service.create_tenant(name)
    _, other_secret = registry_service.create_api_key("other")
    registry_service.sync_flag_keys("default", ["kept-key"])
    before = [(r.id, r.revoked_at) for r in _rows(registry_service)]
    with pytest.raises(Conflict, match=r"--api-key #2 is already a key of tenant 'other'") as caught:
        registry_service.sync_flag_keys("default", ["brand-new", other_secret])
    assert other_secret not in str(caught.value)
    assert [(r.id, r.revoked_at) for r in _rows(registry_service)] == before
    assert registry_service.authenticate("brand-new") is None

    registry_service.sync_flag_keys("default", ["rotated"])  # revokes kept-key
    with pytest.raises(Conflict, match=r"--api-key #1 .* was revoked"):
        registry_service.sync_flag_keys("default", ["kept-key"])
    assert registry_service.authenticate("rotated") == "default"  # the refused start revoked nothing


@pytest.mark.parametrize("bad", ["", " padded", "tab\tkey", "x" * 257, "caf\u00e9"])
def test_keys_no_client_could_send_are_refused(registry_service, bad):
    registry_service.create_tenant("default")
    with pytest.raises(InvalidName, match=r"--api-key #1"):
        registry_service.sync_flag_keys("default", [bad])
    assert _rows(registry_service) == []


def test_keys_need_the_tenant(registry_service):
    with pytest.raises(NotFound):
        registry_service.sync_flag_keys("default", [VLLM_KEY])
    assert registry_service.sync_flag_keys("nobody", []).revoked == 0  # nothing to revoke, no tenant needed


def test_replicas_starting_at_once_store_each_key_once(registry_service):
    registry_service.create_tenant("default")
    barrier = threading.Barrier(4)

    def start(_):
        barrier.wait()
        return registry_service.sync_flag_keys("default", [VLLM_KEY, "second-key"])

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(start, range(4)))
    assert sum(r.added for r in results) == 2
    assert len(_rows(registry_service)) == 2
    assert registry_service.authenticate(VLLM_KEY) == "default"


def test_keys_stored_before_the_origin_column_stay_loraplex_keys(database_url):
    from loraplex.registry.service import RegistryService

    db.upgrade(database_url, "0001")
    engine = db.make_engine(database_url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("INSERT INTO tenant (name, created_at) VALUES ('acme', CURRENT_TIMESTAMP)")
            conn.exec_driver_sql(
                "INSERT INTO api_key (tenant_id, secret_sha256, prefix, created_at) "
                f"SELECT id, '{hashlib.sha256(b'lpx_old').hexdigest()}', 'lpx_old', CURRENT_TIMESTAMP FROM tenant"
            )
    finally:
        engine.dispose()
    db.upgrade(database_url)
    service = RegistryService.from_url(database_url)
    assert service.authenticate("lpx_old") == "acme"
    assert [k.origin for k in service.list_api_keys("acme")] == [None]
    service.sync_flag_keys("acme", [])  # start-up never revokes them
    assert service.authenticate("lpx_old") == "acme"


def test_another_tenants_flag_keys_are_left_alone(registry_service):
    # two deployments on one database, each serving its own --vllm-tenant with its own key
    for name in ("llama-users", "qwen-users"):
        registry_service.create_tenant(name)
    registry_service.sync_flag_keys("llama-users", ["key-llama"])
    registry_service.sync_flag_keys("qwen-users", ["key-qwen"])
    assert registry_service.sync_flag_keys("llama-users", ["key-llama"]).revoked == 0  # a restart
    assert registry_service.authenticate("key-qwen") == "qwen-users"
    assert registry_service.sync_flag_keys("qwen-users", ["key-qwen-2"]).revoked == 1  # its own rotation
    assert registry_service.authenticate("key-qwen") is None
    assert registry_service.authenticate("key-llama") == "llama-users"
