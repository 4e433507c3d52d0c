"""API keys an operator gives on the command line (vLLM's ``loraplex serve --api-key``).

They are tenant keys like any other, stored hashed (``keys.hash_secret``), and marked with
``origin = KEY_ORIGIN_SERVE_FLAG`` so a later start can tell them from keys made through the admin
API or the CLI. ``sync_flag_keys`` makes the stored flag keys match a command line in one
transaction: listed keys not stored yet are added, that tenant's flag keys no longer listed are
revoked, so rotating the flag rotates the key; other keys are never touched, nor are other
tenants' flag keys: two deployments on one database, each with its own ``--vllm-tenant`` and
keys, must not revoke each other's keys at every start (a move to another ``--vllm-tenant``
leaves the old tenant's flag keys live: revoke them through the admin API, ``DELETE
/admin/v1/tenants/{t}/keys/{id}``). Safe when several replicas start at once with the same
flags: a replica that loses the race to insert a key retries and finds it stored.

Refused (``Conflict``, nothing changed): a listed key that is a key of another tenant, and a
listed key that was revoked (revocation is final here as everywhere in loraplex: an old replica
restarting with a rotated-out key must not bring it back). Messages name a key by its position on
the command line, never by its text.
"""

from __future__ import annotations

import random
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplex.registry import repository as repo
from loraplex.registry.errors import Conflict, InvalidName, NotFound
from loraplex.registry.keys import MAX_SECRET_LENGTH, hash_secret
from loraplex.registry.models import KEY_ORIGIN_SERVE_FLAG, Tenant, utcnow

FLAG_KEY_PREFIX = "(--api-key)"  # shown where loraplex's keys show their first characters
FLAG_ACTOR = "serve --api-key"
SYNC_ATTEMPTS = 8


@dataclass(frozen=True)
class FlagKeySync:
    """What ``sync_flag_keys`` did, as counts (never the secrets)."""

    added: int
    kept: int
    revoked: int


def check_flag_key(secret: str, position: int) -> None:
    """Refuse (``InvalidName``) a key no client could send in an ``Authorization`` header as
    given: empty, longer than ``MAX_SECRET_LENGTH``, outside printable ASCII, or with spaces at
    either end (the server strips those from the header). ``position`` counts from 1."""
    where = f"--api-key #{position}"
    if not secret or len(secret) > MAX_SECRET_LENGTH:
        raise InvalidName(f"{where}: a key has 1 to {MAX_SECRET_LENGTH} characters")
    if not all(" " <= ch <= "~" for ch in secret) or secret != secret.strip():
        raise InvalidName(f"{where}: a key is printable ASCII without spaces at either end")


class FlagKeysMixin:
    """Command-line key methods of RegistryService."""

    def _transaction(self) -> AbstractContextManager[Session]:  # provided by RegistryService
        raise NotImplementedError

    def sync_flag_keys(self, tenant: str, secrets: list[str], actor: str = FLAG_ACTOR) -> FlagKeySync:
        """Make ``secrets`` the flag keys of ``tenant`` (see the module doc). Raises
        ``InvalidName`` for a malformed key, ``NotFound`` without the tenant, ``Conflict`` for a
        key that belongs to another tenant or was revoked."""
        positions = flag_key_positions(secrets)
        for attempt in range(SYNC_ATTEMPTS):
            try:
                return self._sync_once(tenant, positions, actor)
            except IntegrityError:  # another replica stored one of these keys first
                if attempt == SYNC_ATTEMPTS - 1:
                    raise Conflict("replicas kept storing the same --api-key at once; try again") from None
                time.sleep(random.uniform(0, 0.002 * 2**attempt))
        raise AssertionError("unreachable")

    def _sync_once(self, tenant: str, positions: dict[str, int], actor: str) -> FlagKeySync:
        with self._transaction() as session:
            tenant_row = repo.lock_tenant(session, tenant, exclusive=False)  # against a tenant delete
            return sync_flag_keys_in(session, tenant_row, tenant, positions, actor)


def flag_key_positions(secrets: list[str]) -> dict[str, int]:
    """Each listed key's hash -> its first position on the command line (from 1), every key
    checked first (``check_flag_key``)."""
    positions: dict[str, int] = {}
    for position, secret in enumerate(secrets, start=1):
        check_flag_key(secret, position)
        positions.setdefault(hash_secret(secret), position)
    return positions


def sync_flag_keys_in(session: Session, tenant_row: Tenant | None, tenant: str, positions: dict[str, int],
                      actor: str) -> FlagKeySync:
    """``sync_flag_keys``'s reads and writes in ``session``, which holds ``tenant_row``'s shared
    lock (``repo.lock_tenant``; None: no such tenant). ``positions`` from ``flag_key_positions``."""
    if tenant_row is None and positions:  # with no keys listed there is only revoking to do
        raise NotFound(f"tenant {tenant!r} not found")
    missing = []
    for digest, position in positions.items():
        found = repo.find_api_key_by_hash(session, digest)
        if found is None:
            missing.append(digest)
            continue
        key, owner = found
        if owner != tenant:
            raise Conflict(
                f"--api-key #{position} is already a key of tenant {owner!r} (key id {key.id}); a key "
                f"belongs to one tenant: give another key, or serve that tenant with --vllm-tenant {owner}"
            )
        if key.revoked_at is not None:
            raise Conflict(
                f"--api-key #{position} is key id {key.id} of tenant {tenant!r}, which was revoked; "
                "a revoked key is not restored: give a new key"
            )
    revoked = 0
    for key, owner in repo.live_api_keys_of_origin(session, KEY_ORIGIN_SERVE_FLAG):
        if owner != tenant or key.secret_sha256 in positions:
            continue
        key.revoked_at = utcnow()
        revoked += 1
        repo.add_audit_event(
            session, actor=actor, action="api_key.revoke", tenant=owner, object_type="api_key",
            object_name=str(key.id), detail={"prefix": key.prefix, "origin": KEY_ORIGIN_SERVE_FLAG},
        )
    for digest in missing:
        key = repo.add_api_key(session, tenant_row, digest, FLAG_KEY_PREFIX, origin=KEY_ORIGIN_SERVE_FLAG)
        repo.add_audit_event(
            session, actor=actor, action="api_key.create", tenant=tenant, object_type="api_key",
            object_name=str(key.id), detail={"prefix": key.prefix, "origin": KEY_ORIGIN_SERVE_FLAG},
        )
    session.flush()
    return FlagKeySync(added=len(missing), kept=len(positions) - len(missing), revoked=revoked)
