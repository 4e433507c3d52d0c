"""Tenants, API keys and the admin key, on SQLite and PostgreSQL."""

from __future__ import annotations

import hashlib

import pytest

from loraplex.registry.errors import AlreadyExists, InvalidName, NotFound, RegistryError
from loraplex.registry.keys import hash_secret


def test_create_list_get_tenants(registry_service):
    created = registry_service.create_tenant("beta")
    registry_service.create_tenant("alpha")
    assert created.name == "beta" and created.created_at.tzinfo is not None
    assert [t.name for t in registry_service.list_tenants()] == ["alpha", "beta"]
    assert registry_service.get_tenant("alpha").name == "alpha"
    assert registry_service.get_tenant("nobody") is None


def test_duplicate_and_invalid_tenants_are_refused(registry_service):
    registry_service.create_tenant("acme")
    with pytest.raises(AlreadyExists, match="acme"):
        registry_service.create_tenant("acme")
    with pytest.raises(InvalidName):
        registry_service.create_tenant("../acme")
    assert [t.name for t in registry_service.list_tenants()] == ["acme"]
    assert AlreadyExists.http_status == 409 and NotFound.http_status == 404 and InvalidName.http_status == 400


def test_api_key_lifecycle(registry_service):
    registry_service.create_tenant("acme")
    registry_service.create_tenant("other")
    info, secret = registry_service.create_api_key("acme")
    assert secret.startswith("lpx_") and len(secret) >= 40
    assert info.prefix == secret[: len(info.prefix)] and len(info.prefix) < len(secret) / 2
    assert registry_service.authenticate(secret) == "acme"

    other_info, other_secret = registry_service.create_api_key("other")
    assert other_secret != secret
    assert registry_service.authenticate(other_secret) == "other"

    for wrong in ("", "lpx_", secret[:-1], secret + "x", secret.upper(), "Bearer " + secret, "x" * 10_000, None):
        assert registry_service.authenticate(wrong) is None

    assert [k.id for k in registry_service.list_api_keys("acme")] == [info.id]
    revoked = registry_service.revoke_api_key("acme", info.id)
    assert revoked.revoked and revoked.revoked_at is not None
    assert registry_service.authenticate(secret) is None
    assert registry_service.authenticate(other_secret) == "other"
    assert registry_service.revoke_api_key("acme", info.id).revoked_at == revoked.revoked_at  # idempotent

    with pytest.raises(NotFound):  # a tenant cannot revoke another tenant's key
        registry_service.revoke_api_key("acme", other_info.id)
    for key_id in (0, -1, 2**31, 2**63, 10**40, "9223372036854775808"):  # the databases' overflow was a 500
        with pytest.raises(NotFound):
            registry_service.revoke_api_key("acme", key_id)
    with pytest.raises(NotFound):
        registry_service.create_api_key("nobody")


def test_only_the_hash_of_a_secret_is_stored(registry_url, registry_service):
    from sqlalchemy import text

    from loraplex.registry.db import make_engine

    registry_service.create_tenant("acme")
    _, secret = registry_service.create_api_key("acme")
    engine = make_engine(registry_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT secret_sha256, prefix FROM api_key")).all()
            audit = conn.execute(text("SELECT detail FROM audit_event")).all()
    finally:
        engine.dispose()
    assert rows[0][0] == hashlib.sha256(secret.encode()).hexdigest()
    assert secret not in repr(rows) + repr(audit)


def test_admin_key_is_generated_once_and_checked(registry_service):
    assert not registry_service.check_admin_key("anything")
    secret = registry_service.get_or_create_admin_key()
    assert secret and secret.startswith("lpx_admin_")
    assert registry_service.get_or_create_admin_key() is None  # only the first start prints one
    assert registry_service.admin_key_hash() == hashlib.sha256(secret.encode()).hexdigest()
    assert registry_service.check_admin_key(secret)
    assert not registry_service.check_admin_key(secret[:-1])
    assert not registry_service.check_admin_key("")
    assert registry_service.authenticate(secret) is None  # the admin key is not a tenant key

    registry_service.set_admin_key_hash(hash_secret("operator-chosen"))
    assert registry_service.check_admin_key("operator-chosen")
    assert not registry_service.check_admin_key(secret)
    with pytest.raises(RegistryError):
        registry_service.set_admin_key_hash("not-a-hash")


def test_key_changes_are_audited(registry_service):
    registry_service.create_tenant("acme")
    info, _ = registry_service.create_api_key("acme", actor="alice")
    registry_service.revoke_api_key("acme", info.id, actor="bob")
    events = registry_service.list_audit(tenant="acme")
    assert [(e.action, e.actor, e.object_name) for e in events] == [
        ("api_key.revoke", "bob", str(info.id)),
        ("api_key.create", "alice", str(info.id)),
        ("tenant.create", "admin", "acme"),
    ]
