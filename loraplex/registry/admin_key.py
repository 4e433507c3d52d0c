"""Admin key storage: the server's admin secret is generated once, stored hashed, printed once."""

from __future__ import annotations

import re
from contextlib import AbstractContextManager

from sqlalchemy import update
from sqlalchemy.orm import Session

from loraplex.registry import repository as repo
from loraplex.registry.errors import RegistryError
from loraplex.registry.keys import ADMIN_SECRET_PREFIX, MAX_SECRET_LENGTH, generate_secret, hash_secret, secret_matches
from loraplex.registry.models import REGISTRY_STATE_ID, RegistryState

SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


class AdminKeyMixin:
    """Admin key methods of RegistryService (the hash lives in the registry_state row)."""

    def _transaction(self) -> AbstractContextManager[Session]:  # provided by RegistryService
        raise NotImplementedError

    # ---- admin key -------------------------------------------------------------------------

    def admin_key_hash(self) -> str | None:
        with self._transaction() as session:
            return repo.get_state(session).admin_key_sha256

    def set_admin_key_hash(self, sha256: str, actor: str = "admin") -> None:
        """Store the hash of an admin key (e.g. ``keys.hash_secret(settings.admin_key)``)."""
        if not isinstance(sha256, str) or not SHA256_HEX.match(sha256):
            raise RegistryError("admin key hash must be 64 lower-case hex characters (sha256)")
        with self._transaction() as session:
            repo.get_state(session).admin_key_sha256 = sha256
            repo.add_audit_event(
                session, actor=actor, action="admin_key.set", tenant=None, object_type="admin_key", object_name="admin"
            )

    def get_or_create_admin_key(self, actor: str = "system") -> str | None:
        """Generate and store (hashed) an admin key if none is stored yet.

        Returns the new secret (print it once), or None when a key already exists. Safe when
        several replicas start at once: only one of them wins the conditional update.
        """
        secret = generate_secret(ADMIN_SECRET_PREFIX)
        with self._transaction() as session:
            repo.get_state(session)
            result = session.execute(
                update(RegistryState)
                .where(RegistryState.id == REGISTRY_STATE_ID, RegistryState.admin_key_sha256.is_(None))
                .values(admin_key_sha256=hash_secret(secret))
                .execution_options(synchronize_session=False)
            )
            if result.rowcount != 1:
                return None
            repo.add_audit_event(
                session, actor=actor, action="admin_key.create", tenant=None, object_type="admin_key",
                object_name="admin",
            )
            return secret

    def check_admin_key(self, secret: str) -> bool:
        if not isinstance(secret, str) or not secret or len(secret) > MAX_SECRET_LENGTH:
            return False
        return secret_matches(secret, self.admin_key_hash())
