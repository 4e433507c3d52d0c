"""Tenant API keys (RegistryService's mixin): made here with a generated secret, shown once,
stored as its hash; revoked, never deleted; looked up by the hash of what a client sends."""

from __future__ import annotations

from contextlib import AbstractContextManager

from sqlalchemy.orm import Session

from loraplex.registry import repository as repo
from loraplex.registry.errors import NotFound
from loraplex.registry.info import ApiKeyInfo
from loraplex.registry.keys import display_prefix, generate_secret, hash_secret, plausible_secret, secret_matches
from loraplex.registry.models import Tenant, utcnow

MAX_KEY_ID = 2**31 - 1  # the id column is an INTEGER: PostgreSQL refuses to compare more (SQLite 2**63)


class ApiKeysMixin:
    """API key methods of RegistryService."""

    def _transaction(self) -> AbstractContextManager[Session]:  # provided by RegistryService
        raise NotImplementedError

    @staticmethod
    def _require_tenant(session: Session, name: str, *, for_update: bool = False, lock: bool = False) -> Tenant:
        raise NotImplementedError  # provided by RegistryService

    def create_api_key(self, tenant: str, actor: str = "admin") -> tuple[ApiKeyInfo, str]:
        """A new key for ``tenant``; the secret is returned here once and never stored."""
        secret = generate_secret()
        with self._transaction() as session:  # locked: a key added during a tenant delete would outlive it
            tenant_row = self._require_tenant(session, tenant, lock=True)
            row = repo.add_api_key(session, tenant_row, hash_secret(secret), display_prefix(secret))
            repo.add_audit_event(
                session, actor=actor, action="api_key.create", tenant=tenant, object_type="api_key",
                object_name=str(row.id), detail={"prefix": row.prefix},
            )
            return ApiKeyInfo.from_row(row, tenant), secret

    def list_api_keys(self, tenant: str) -> list[ApiKeyInfo]:
        with self._transaction() as session:
            rows = repo.list_api_keys(session, self._require_tenant(session, tenant))
            return [ApiKeyInfo.from_row(r, tenant) for r in rows]

    def revoke_api_key(self, tenant: str, key_id: int, actor: str = "admin") -> ApiKeyInfo:
        """Revoke a key (idempotent). Raises NotFound if the tenant has no such key."""
        try:
            key_id = int(key_id)
        except (TypeError, ValueError):
            raise NotFound(f"API key {key_id!r} not found for tenant {tenant!r}") from None
        if not 0 < key_id <= MAX_KEY_ID:  # no row has it, and the database cannot compare it (a 500)
            raise NotFound(f"API key {key_id} not found for tenant {tenant!r}")
        with self._transaction() as session:
            row = repo.get_api_key(session, self._require_tenant(session, tenant), key_id)
            if row is None:
                raise NotFound(f"API key {key_id} not found for tenant {tenant!r}")
            if row.revoked_at is None:
                row.revoked_at = utcnow()
                session.flush()
                repo.add_audit_event(
                    session, actor=actor, action="api_key.revoke", tenant=tenant, object_type="api_key",
                    object_name=str(row.id), detail={"prefix": row.prefix},
                )
            return ApiKeyInfo.from_row(row, tenant)

    def authenticate(self, secret: str) -> str | None:
        """The tenant name for a valid, unrevoked key; None for anything else."""
        if not plausible_secret(secret):
            return None
        with self._transaction() as session:
            found = repo.find_api_key_by_hash(session, hash_secret(secret), live_tenant_only=True)
            if found is None:
                return None
            key, tenant_name = found
            if key.revoked_at is not None or not secret_matches(secret, key.secret_sha256):
                return None
            return tenant_name
