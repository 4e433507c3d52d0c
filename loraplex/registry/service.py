"""RegistryService: tenants, API keys, versioned adapters, hot-swap and audit, one transaction each.

Every public method opens its own session and transaction and returns plain dataclasses
(``info.py``). Mutations of one adapter first lock its row (``SELECT ... FOR UPDATE`` on
PostgreSQL; SQLite serialises writers anyway), so a hot-swap, an upload and a delete of the same
adapter never interleave. Every change writes an audit event in the same transaction; every
change to what a name resolves to also bumps the change counter that ``watch.RegistryWatcher``
polls in other processes.

Deleted versions stay as tombstones: their numbers are never reused, so ``name@3`` can never
come to mean other weights. Deleting the active version is refused (activate another first, or
delete the whole adapter).

Blobs are shared by content (any tenant), so "no version row without its blob" needs one more
lock: ``add_version`` and ``delete_blob_if_unused`` both take the blob's lock
(``repository.lock_blob``: a PostgreSQL advisory lock, SQLite's write lock) first in their
transaction. A deleter counts the live versions using the blob and deletes it while holding the
lock; an uploader checks, under the same lock, that the blob is still there before its row is
committed. So a row is either committed before the count (the blob stays) or its uploader sees
the blob gone and stores it again. This needs READ COMMITTED on PostgreSQL (its default, which
the engines here keep): each statement after the lock sees everything committed before it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from loraplex.registry import repository as repo
from loraplex.registry.adapter_origin import claim_for, refuse_unless_runtime
from loraplex.registry.admin_key import AdminKeyMixin
from loraplex.registry.api_keys import ApiKeysMixin
from loraplex.registry.db import make_session_factory
from loraplex.registry.errors import (AlreadyExists, BlobMissing, Conflict, InvalidName, InvalidSetting, NotFound,
                                     RegistryError, TenantDeleted)  # noqa: F401 - re-exported
from loraplex.registry.flag_keys import FlagKeysMixin
from loraplex.registry.info import AdapterInfo, ApiKeyInfo, AuditEventInfo, TenantInfo, VersionInfo
from loraplex.registry.models import VERSION_DELETED, Adapter, Tenant, utcnow
from loraplex.registry.names import parse_model_ref, parse_version, validate_adapter_name, validate_tenant_name
from loraplex.registry.replicas import ReplicaHeartbeatMixin
from loraplex.registry.serve_flags import ServeFlagsMixin
from loraplex.registry.tenant_delete import TenantDeleteMixin, TenantDeletion, refuse_taken_name
from loraplex.registry.tenant_settings import TenantSettingsMixin
from loraplex.registry.usage import UsageMixin
from loraplex.registry.version_batch import VersionBatchMixin, hot_swap, version_fields

__all__ = [
    "RegistryService",
    "RegistryError",
    "NotFound",
    "AlreadyExists",
    "Conflict",
    "BlobMissing",
    "InvalidName",
    "InvalidSetting",
    "TenantDeleted",
    "TenantDeletion",
    "TenantInfo",
    "ApiKeyInfo",
    "VersionInfo",
    "AdapterInfo",
    "AuditEventInfo",
]

WRITE_ATTEMPTS = 8  # retries of a write that lost a race on a unique constraint
# Before retry n a loser sleeps a random time up to RETRY_BACKOFF_S * 2**n: without it, writers
# that collided once (SQLite has no row locks, so FOR UPDATE does not serialise them) collide
# again at once, and under CPU load one of four could lose five times in a row.
RETRY_BACKOFF_S = 0.002


class RegistryService(AdminKeyMixin, ApiKeysMixin, TenantSettingsMixin, TenantDeleteMixin, FlagKeysMixin,
                      UsageMixin, VersionBatchMixin, ServeFlagsMixin, ReplicaHeartbeatMixin):
    """The registry's public API. Thread-safe: it holds only a session factory."""

    def __init__(self, session_factory: sessionmaker[Session]):
        self._session_factory = session_factory

    @classmethod
    def from_url(cls, url: str) -> RegistryService:
        """A service on ``url`` (run ``db.upgrade(url)`` first)."""
        return cls(make_session_factory(url))

    @contextmanager
    def _transaction(self) -> Iterator[Session]:
        with self._session_factory() as session, session.begin():
            yield session

    def ping(self) -> bool:
        """True when the database answers (for readiness checks)."""
        try:
            with self._transaction() as session:
                session.execute(text("SELECT 1"))
            return True
        except SQLAlchemyError:
            return False

    # ---- tenants ---------------------------------------------------------------------------

    def create_tenant(self, name: str, actor: str = "admin") -> TenantInfo:
        validate_tenant_name(name)
        try:
            with self._transaction() as session:
                if refuse_taken_name(repo.get_tenant(session, name, include_deleted=True)):
                    raise AlreadyExists(f"tenant {name!r} already exists")
                tenant = repo.add_tenant(session, name)
                repo.add_audit_event(
                    session, actor=actor, action="tenant.create", tenant=name, object_type="tenant", object_name=name
                )
                return TenantInfo.from_row(tenant)
        except IntegrityError:
            raise AlreadyExists(f"tenant {name!r} already exists") from None

    def list_tenants(self) -> list[TenantInfo]:
        with self._transaction() as session:
            return [TenantInfo.from_row(t) for t in repo.list_tenants(session)]

    def get_tenant(self, name: str) -> TenantInfo | None:
        validate_tenant_name(name)
        with self._transaction() as session:
            tenant = repo.get_tenant(session, name)
            return None if tenant is None else TenantInfo.from_row(tenant)

    @staticmethod
    def _require_tenant(session: Session, name: str, *, for_update: bool = False, lock: bool = False) -> Tenant:
        """The live tenant or NotFound; ``lock``: shared against a tenant delete (``repo.lock_tenant``)."""
        validate_tenant_name(name)
        tenant = repo.lock_tenant(session, name, exclusive=False) if lock else repo.get_tenant(
            session, name, for_update=for_update)
        if tenant is None:
            raise NotFound(f"tenant {name!r} not found")
        return tenant

    # ---- adapters --------------------------------------------------------------------------

    def add_version(
        self,
        tenant: str,
        name: str,
        *,
        sha256: str,
        base_model: str,
        rank: int,
        alpha: float,
        targets: Sequence[str],
        size_bytes: int,
        blob_key: str,
        uploader: str,
        activate_if_first: bool = True,
        check_blob: Callable[[], bool] | None = None,
        origin: str | None = None,
        activate: bool = False,
        create_only: bool = False,
    ) -> tuple[VersionInfo, bool]:
        """Record a new immutable version (its blob must already be stored).

        Returns ``(version, True)``, or ``(existing, False)`` when a live version of this adapter
        has the same sha256. With ``activate_if_first`` the new version becomes active when the
        adapter has no active version; with ``activate`` the version returned becomes the active
        one in the same transaction (a hot-swap, audited as ``activate`` audits it), so no other
        write can come between the two.

        ``check_blob`` (say, ``lambda: store.exists(blob_key)``) is called holding the blob's
        lock, before the new row is written; when it returns False nothing is written and
        ``BlobMissing`` is raised (a concurrent ``delete_blob_if_unused`` removed the blob: store
        it again and retry). Keep it short: on SQLite it runs holding the write lock.

        ``origin`` is who writes (``adapter_origin``): ``ADAPTER_ORIGIN_RUNTIME`` may only add to
        an adapter it created (else ``ManagedByOperator``, nothing written); the operator's
        write (None) makes the adapter the operator's. ``create_only``: ``AlreadyExists``, nothing
        written, when the adapter already lives (decided under the lock: of two such writers to a
        new name, one creates it).
        """
        validate_adapter_name(name)
        fields = version_fields(sha256, base_model, rank, alpha, targets, size_bytes, blob_key, uploader)
        for attempt in range(WRITE_ATTEMPTS):
            try:
                return self._add_version_once(tenant, name, fields, activate_if_first, check_blob, origin, activate,
                                              create_only)
            except IntegrityError:
                # another writer created the adapter or took the version number first; retry
                if attempt == WRITE_ATTEMPTS - 1:
                    raise Conflict(f"concurrent uploads to {tenant}/{name}; try again") from None
                time.sleep(random.uniform(0, RETRY_BACKOFF_S * 2**attempt))
        raise AssertionError("unreachable")

    def _add_version_once(
        self,
        tenant: str,
        name: str,
        fields: dict[str, Any],
        activate_if_first: bool,
        check_blob: Callable[[], bool] | None,
        origin: str | None,
        activate: bool,
        create_only: bool = False,
    ) -> tuple[VersionInfo, bool]:
        with self._transaction() as session:
            # first, so that a blob delete cannot run between our check and our commit (and, on
            # SQLite, so that everything read below is current: the write lock is ours)
            repo.lock_blob(session, fields["blob_key"])
            # shared lock: a tenant delete waits for this upload (and then deletes its version),
            # or this upload waits for the delete and finds no tenant
            tenant_row = self._require_tenant(session, tenant, lock=True)
            version, created = self._put_version(session, tenant_row, name, fields, activate_if_first, check_blob,
                                                 origin, create_only)
            if activate:
                adapter = repo.get_adapter(session, tenant_row, name)
                if adapter.active_version != version.version:
                    hot_swap(session, tenant, adapter, version, uploader=fields["uploader"])
            return version, created

    @staticmethod
    def _put_version(session: Session, tenant_row: Tenant, name: str, fields: dict[str, Any],
                     activate_if_first: bool, check_blob: Callable[[], bool] | None,
                     origin: str | None, create_only: bool = False) -> tuple[VersionInfo, bool]:
        """``add_version``'s writes, in ``session`` (which holds the blob's and tenant's locks)."""
        tenant = tenant_row.name
        adapter = repo.get_adapter(session, tenant_row, name, for_update=True)
        if adapter is None:
            adapter = repo.add_adapter(session, tenant_row, name, origin=origin)
            repo.add_audit_event(
                session, actor=fields["uploader"], action="adapter.create", tenant=tenant,
                object_type="adapter", object_name=name,
            )
        elif adapter.deleted_at is not None:
            adapter.deleted_at = None  # re-created: numbering continues after the tombstones
            adapter.active_version = None  # its first new version becomes active, as a new name's
            adapter.origin = origin
        else:
            if create_only:
                raise AlreadyExists(f"adapter {name!r} already exists for tenant {tenant!r}")
            claim_for(adapter, origin)
            existing = repo.find_live_version_by_sha(session, adapter, fields["sha256"])
            if existing is not None:
                return VersionInfo.from_row(existing, tenant, name), False
        if check_blob is not None and not check_blob():
            raise BlobMissing(f"blob {fields['blob_key']} is no longer in the store; version row not written")
        number = repo.next_version_number(session, adapter)
        version = repo.add_version(session, adapter, number, **fields)
        detail = {"version": number, "sha256": fields["sha256"], "size_bytes": fields["size_bytes"]}
        repo.add_audit_event(
            session, actor=fields["uploader"], action="adapter.upload", tenant=tenant,
            object_type="adapter", object_name=f"{name}@{number}", detail=detail,
        )
        if activate_if_first and adapter.active_version is None:
            adapter.active_version = number
            session.flush()
            repo.bump_change_counter(session)
            repo.add_audit_event(
                session, actor=fields["uploader"], action="adapter.activate", tenant=tenant,
                object_type="adapter", object_name=name, detail={"from": None, "to": number},
            )
        return VersionInfo.from_row(version, tenant, name), True

    def list_adapters(self, tenant: str) -> list[AdapterInfo]:
        with self._transaction() as session:
            adapters = repo.list_adapters(session, self._require_tenant(session, tenant))
            versions = repo.live_versions_of(session, adapters)
            return [AdapterInfo.from_row(a, tenant, versions[a.id]) for a in adapters]

    def get_adapter(self, tenant: str, name: str) -> AdapterInfo | None:
        validate_adapter_name(name)
        with self._transaction() as session:
            adapter = repo.get_adapter(session, self._require_tenant(session, tenant), name)
            if adapter is None or adapter.deleted_at is not None:
                return None
            return AdapterInfo.from_row(adapter, tenant, repo.live_versions(session, adapter))

    def resolve(self, tenant: str, model_ref: str) -> VersionInfo:
        """``"name"`` -> its active version; ``"name@3"`` -> version 3. Raises NotFound."""
        name, number = parse_model_ref(model_ref)
        with self._transaction() as session:
            adapter = self._require_adapter(session, tenant, name)
            if number is None:
                if adapter.active_version is None:
                    raise NotFound(f"adapter {name!r} has no active version")
                number = adapter.active_version
            return VersionInfo.from_row(self._require_live_version(session, adapter, number), tenant, name)

    def _require_adapter(self, session: Session, tenant: str, name: str, *, for_update: bool = False) -> Adapter:
        validate_adapter_name(name)
        if for_update:  # before the tenant's read: on SQLite, what both read is then current
            repo.serialise_writer(session)
        adapter = repo.get_adapter(session, self._require_tenant(session, tenant), name, for_update=for_update)
        if adapter is None or adapter.deleted_at is not None:
            raise NotFound(f"adapter {name!r} not found for tenant {tenant!r}")
        return adapter

    @staticmethod
    def _require_live_version(session: Session, adapter: Adapter, number: int):
        version = repo.get_version(session, adapter, number)
        if version is None:
            raise NotFound(f"adapter {adapter.name!r} has no version {number}")
        if version.state == VERSION_DELETED:
            raise NotFound(f"version {number} of adapter {adapter.name!r} was deleted")
        return version

    def activate(self, tenant: str, name: str, version: int, actor: str = "admin",
                 origin: str | None = None) -> VersionInfo:
        """Hot-swap: point ``name`` at ``version`` atomically; audited; bumps the change counter.
        A runtime ``origin`` may only activate a runtime adapter (``adapter_origin``)."""
        number = parse_version(version)
        with self._transaction() as session:
            adapter = self._require_adapter(session, tenant, name, for_update=True)
            refuse_unless_runtime(adapter, origin)
            row = self._require_live_version(session, adapter, number)
            previous = adapter.active_version
            if previous != number:
                adapter.active_version = number
                session.flush()
                repo.bump_change_counter(session)
            repo.add_audit_event(
                session, actor=actor, action="adapter.activate", tenant=tenant, object_type="adapter",
                object_name=name, detail={"from": previous, "to": number, "sha256": row.sha256},
            )
            return VersionInfo.from_row(row, tenant, name)

    def delete_version(self, tenant: str, name: str, version: int, actor: str = "admin") -> list[VersionInfo]:
        """Delete one (non-active) version; returns it so the caller can drop its blob once unused."""
        number = parse_version(version)
        with self._transaction() as session:
            adapter = self._require_adapter(session, tenant, name, for_update=True)
            row = self._require_live_version(session, adapter, number)
            if adapter.active_version == number:
                raise Conflict(
                    f"version {number} is the active version of {name!r}; activate another version "
                    "first, or delete the whole adapter"
                )
            self._tombstone(row)
            session.flush()
            repo.bump_change_counter(session)
            repo.add_audit_event(
                session, actor=actor, action="adapter.version.delete", tenant=tenant, object_type="adapter",
                object_name=f"{name}@{number}", detail={"sha256": row.sha256, "blob_key": row.blob_key},
            )
            return [VersionInfo.from_row(row, tenant, name)]

    def delete_adapter(self, tenant: str, name: str, actor: str = "admin",
                       origin: str | None = None) -> list[VersionInfo]:
        """Delete an adapter and all its versions; returns the versions removed. A runtime
        ``origin`` may only delete a runtime adapter (else ``ManagedByOperator``, nothing changed)."""
        with self._transaction() as session:
            adapter = self._require_adapter(session, tenant, name, for_update=True)
            refuse_unless_runtime(adapter, origin)
            removed = repo.live_versions(session, adapter)
            for row in removed:
                self._tombstone(row)
            adapter.active_version = None
            adapter.deleted_at = utcnow()
            session.flush()
            repo.bump_change_counter(session)
            repo.add_audit_event(
                session, actor=actor, action="adapter.delete", tenant=tenant, object_type="adapter",
                object_name=name, detail={"versions": [r.number for r in removed]},
            )
            return [VersionInfo.from_row(r, tenant, name) for r in removed]

    @staticmethod
    def _tombstone(row) -> None:
        row.state = VERSION_DELETED
        row.deleted_at = utcnow()

    def versions_using_blob(self, blob_key: str) -> int:
        """How many live versions (any tenant) use this blob. Informational: to delete a blob
        use ``delete_blob_if_unused``, which counts and deletes under the blob's lock."""
        with self._transaction() as session:
            return repo.count_live_versions_with_blob(session, blob_key)

    def deleted_weights(self, content_hashes: Sequence[str]) -> set[str]:
        """Of ``content_hashes``, the weights that versions had and no live version (of any
        tenant) has any more; a hash no version ever had (a merge built in memory) is not one."""
        if not content_hashes:
            return set()
        with self._transaction() as session:
            return repo.shas_without_live_version(session, list(content_hashes))

    def delete_blob_if_unused(self, blob_key: str, delete: Callable[[], None]) -> bool:
        """Call ``delete()`` (which removes the blob ``blob_key`` from the store) when no live
        version, of any tenant, uses it; return whether it was called. Exceptions from
        ``delete`` propagate.

        ``delete`` runs inside a transaction that holds the blob's lock, taken before the count;
        ``add_version`` takes the same lock. So a version row using the blob is either committed
        before the count (and the blob stays), or written after ``delete`` returned, by an
        uploader whose ``check_blob`` then finds the blob gone. This holds across processes
        sharing the database. Keep ``delete`` to the blob delete (and local cleanup): on SQLite
        it runs holding the database's write lock.
        """
        if self.versions_using_blob(blob_key) > 0:
            return False  # used now: keeping a blob is always safe, and this read takes no lock
        with self._transaction() as session:
            repo.lock_blob(session, blob_key)
            if repo.count_live_versions_with_blob(session, blob_key) > 0:
                return False
            delete()
            return True

    # ---- audit and change detection --------------------------------------------------------

    def record_event(
        self,
        actor: str,
        action: str,
        tenant: str | None,
        object_type: str,
        object_name: str,
        detail: dict[str, Any] | None = None,
    ) -> AuditEventInfo:
        """Audit something done outside the registry (load/unload, pin, ...)."""
        with self._transaction() as session:
            row = repo.add_audit_event(
                session, actor=actor, action=action, tenant=tenant, object_type=object_type,
                object_name=object_name, detail=detail,
            )
            return AuditEventInfo.from_row(row)

    def list_audit(self, tenant: str | None = None, limit: int = 100) -> list[AuditEventInfo]:
        """Newest first."""
        with self._transaction() as session:
            return [AuditEventInfo.from_row(r) for r in repo.list_audit_events(session, tenant, max(1, int(limit)))]

    def change_counter(self) -> int:
        with self._transaction() as session:
            return repo.read_change_counter(session)

