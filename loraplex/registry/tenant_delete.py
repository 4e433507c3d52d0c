"""Tenant offboarding: ``delete_tenant`` removes a tenant, its keys and its adapters in one
transaction.

What it does, atomically: every API key of the tenant is revoked; every live adapter and version
is deleted exactly as ``delete_adapter`` deletes one (versions tombstoned, adapter marked
deleted); the tenant row becomes a tombstone (``Tenant.deleted_at``), so its name no longer
authenticates, lists or resolves. One ``tenant.delete`` audit event carries the counts, and the
change counter is bumped so other processes forget what the tenant's names resolved to.

Tombstone, not a hard delete, and the name is never reused (``create_tenant`` raises
``TenantDeleted``): usage rows are kept by name for billing (``usage.py``) and outlive the
tenant, and requests in flight at the delete still record theirs under the name afterwards, so
a second tenant of the same name could not be told apart from the first in any report. The
tombstone keeps the old settings; nothing reads them.

Blobs are not touched here: the caller gets the deleted versions back and drops each blob once
no request and no live version of any tenant uses it (``AdapterManager.delete_tenant``).

Locks: the tenant row first (``repo.lock_tenant``, exclusive), then its adapters, then the
change counter: the order ``add_version`` (tenant shared, adapter) and ``delete_adapter``
(adapter, counter) take them, so none of them can deadlock with a tenant delete. An upload or a
key creation that waited on the delete finds no tenant; one that committed first is deleted too.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from sqlalchemy.orm import Session

from loraplex.registry import repository as repo
from loraplex.registry.errors import NotFound, TenantDeleted
from loraplex.registry.info import VersionInfo, _ToDict
from loraplex.registry.models import VERSION_DELETED, utcnow
from loraplex.registry.names import validate_tenant_name


@dataclass(frozen=True)
class TenantDeletion(_ToDict):
    """What ``delete_tenant`` removed: counts, adapter names, and the deleted versions (whose
    blobs the caller drops once unused)."""

    tenant: str
    api_keys_revoked: int
    adapters: list[str] = field(default_factory=list)
    versions: list[VersionInfo] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return {"api_keys_revoked": self.api_keys_revoked, "adapters_deleted": len(self.adapters),
                "versions_deleted": len(self.versions)}


def refuse_taken_name(tenant) -> bool:
    """For ``create_tenant``: raise TenantDeleted when ``tenant`` (the row of the name, tombstones
    included, or None) is a deleted tenant; else whether the name is taken by a live one."""
    if tenant is not None and tenant.deleted_at is not None:
        raise TenantDeleted(
            f"tenant {tenant.name!r} was deleted; tenant names are never reused (usage is kept under the "
            "name for billing): choose another name"
        )
    return tenant is not None


class TenantDeleteMixin:
    """Tenant delete method of RegistryService."""

    def _transaction(self) -> AbstractContextManager[Session]:  # provided by RegistryService
        raise NotImplementedError

    def delete_tenant(self, name: str, actor: str = "admin") -> TenantDeletion:
        """Delete tenant ``name`` (see the module doc). Raises NotFound for a tenant that does not
        exist or was already deleted, InvalidName for a malformed name; then nothing changed."""
        validate_tenant_name(name)
        now = utcnow()
        with self._transaction() as session:
            tenant = repo.lock_tenant(session, name, exclusive=True)
            if tenant is None:
                raise NotFound(f"tenant {name!r} not found")
            revoked = 0
            for key in repo.list_api_keys(session, tenant):
                if key.revoked_at is None:
                    key.revoked_at = now
                    revoked += 1
            adapters = repo.list_adapters(session, tenant, for_update=True)
            live = repo.live_versions_of(session, adapters)
            removed: list[VersionInfo] = []
            for adapter in adapters:
                for version in live[adapter.id]:
                    version.state = VERSION_DELETED
                    version.deleted_at = now
                    removed.append(VersionInfo.from_row(version, name, adapter.name))
                adapter.active_version = None
                adapter.deleted_at = now
            tenant.deleted_at = now
            session.flush()
            repo.bump_change_counter(session)
            deletion = TenantDeletion(name, revoked, [a.name for a in adapters], removed)
            repo.add_audit_event(
                session, actor=actor, action="tenant.delete", tenant=name, object_type="tenant", object_name=name,
                detail=deletion.counts(),
            )
            return deletion
