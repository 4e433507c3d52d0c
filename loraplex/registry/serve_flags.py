"""What ``loraplex serve``'s vLLM flags write in the registry, in one transaction: the tenant
(created when missing), its ``--api-key`` keys (``flag_keys``) and the ``--lora-modules``
versions, each made its adapter's active version (``version_batch``). On any error nothing is
written, so a start that fails leaves no tenant, key or version of its own behind (the server's
side: ``loraplex/server/vllm_startup.py``).

Locks are taken as every writer takes them: the blobs' locks first (in key order), then the
tenant's shared lock. Replicas starting at once: the loser of a race on a unique constraint (the
tenant's name, a key, an adapter or a version number) retries the whole transaction and then
finds the winner's rows.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplex.registry import repository as repo
from loraplex.registry.errors import Conflict, NotFound
from loraplex.registry.flag_keys import FLAG_ACTOR, FlagKeySync, flag_key_positions, sync_flag_keys_in
from loraplex.registry.models import Tenant
from loraplex.registry.names import validate_tenant_name
from loraplex.registry.tenant_delete import refuse_taken_name
from loraplex.registry.version_batch import ActiveVersion, NewVersion, VersionRow, lock_blobs, version_rows

SERVE_FLAGS_ATTEMPTS = 8  # as add_version: a lost race on a unique constraint is retried whole
SERVE_FLAGS_RETRY_BACKOFF_S = 0.002
TENANT_ACTOR = "system"  # who creates the flags' tenant in the audit trail


@dataclass(frozen=True)
class ServeFlagsWrite:
    """What ``apply_serve_flags`` wrote."""

    tenant_created: bool
    keys: FlagKeySync
    modules: list[ActiveVersion]  # in the order given


class ServeFlagsMixin:
    """``apply_serve_flags`` of RegistryService."""

    def _transaction(self) -> AbstractContextManager[Session]:  # provided by RegistryService
        raise NotImplementedError

    def apply_serve_flags(self, tenant: str, secrets: list[str], versions: Sequence[NewVersion], *,
                          create_tenant: bool, uploader: str,
                          check_blob: Callable[[str], bool] | None = None) -> ServeFlagsWrite:
        """In one transaction: create ``tenant`` when missing (with ``create_tenant``; a deleted
        tenant is refused, ``TenantDeleted``), make ``secrets`` its flag keys as
        ``sync_flag_keys`` does, and add and activate ``versions`` as ``add_versions_active``
        does (``check_blob`` as there; a ``RegistryError`` about one adapter carries its name as
        ``adapter``). Any error writes nothing."""
        if create_tenant or secrets or versions:  # else only flag keys of an earlier start are revoked
            validate_tenant_name(tenant)
        positions = flag_key_positions(secrets)
        rows = version_rows(versions, uploader)
        for attempt in range(SERVE_FLAGS_ATTEMPTS):
            try:
                return self._apply_serve_flags_once(tenant, positions, rows, create_tenant, check_blob)
            except IntegrityError:  # another replica stored the tenant, a key or a version first
                if attempt == SERVE_FLAGS_ATTEMPTS - 1:
                    raise Conflict(f"replicas kept writing tenant {tenant!r}'s start-up flags at once; "
                                   "try again") from None
                time.sleep(random.uniform(0, SERVE_FLAGS_RETRY_BACKOFF_S * 2**attempt))
        raise AssertionError("unreachable")

    def _apply_serve_flags_once(self, tenant: str, positions: dict[str, int], rows: list[VersionRow],
                                create_tenant: bool, check_blob: Callable[[str], bool] | None) -> ServeFlagsWrite:
        with self._transaction() as session:
            lock_blobs(session, rows)
            tenant_row = repo.lock_tenant(session, tenant, exclusive=False)  # against a tenant delete
            created = False
            if tenant_row is None and create_tenant:
                tenant_row, created = _create_tenant(session, tenant)
            keys = sync_flag_keys_in(session, tenant_row, tenant, positions, FLAG_ACTOR)
            modules = []
            if rows:
                if tenant_row is None:
                    raise NotFound(f"tenant {tenant!r} not found")
                modules = self._put_versions_active(session, tenant_row, rows, check_blob)  # type: ignore[attr-defined]
            return ServeFlagsWrite(created, keys, modules)


def _create_tenant(session: Session, name: str) -> tuple[Tenant, bool]:
    """The live tenant ``name``, added (and audited, as ``create_tenant``) unless another replica
    committed it since ``lock_tenant`` looked; ``(row, created)``. ``TenantDeleted`` when the
    name is a deleted tenant's (names are never reused)."""
    if refuse_taken_name(repo.get_tenant(session, name, include_deleted=True)):
        return repo.lock_tenant(session, name, exclusive=False), False
    row = repo.add_tenant(session, name)
    repo.add_audit_event(session, actor=TENANT_ACTOR, action="tenant.create", tenant=name, object_type="tenant",
                         object_name=name)
    return row, True
