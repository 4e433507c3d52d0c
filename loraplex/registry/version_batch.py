"""Several adapters' versions added and made active in one transaction, all or nothing
(``serve --lora-modules``: a start registers every module or none), and the checks on a new
version's fields that ``add_version`` shares.

Locks are taken as ``add_version`` takes them (the blobs' locks first, in key order so that two
replicas starting at once cannot deadlock on PostgreSQL's advisory locks; then the tenant's
shared lock), and each adapter is written exactly as ``add_version`` writes it, followed by a
hot-swap when the new (or identical) version is not the active one yet.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplex.registry import repository as repo
from loraplex.registry.admin_key import SHA256_HEX
from loraplex.registry.errors import Conflict, InvalidName, RegistryError
from loraplex.registry.info import VersionInfo
from loraplex.registry.models import Tenant
from loraplex.registry.names import validate_adapter_name

BATCH_WRITE_ATTEMPTS = 8  # as add_version: a lost race on a unique constraint is retried whole
BATCH_RETRY_BACKOFF_S = 0.002
VersionRow = tuple[str, dict[str, Any]]  # an adapter's name and its new version's fields


@dataclass(frozen=True)
class NewVersion:
    """One adapter's version for ``add_versions_active``: its name and ``add_version``'s fields."""

    name: str
    sha256: str
    base_model: str
    rank: int
    alpha: float
    targets: Sequence[str]
    size_bytes: int
    blob_key: str


@dataclass(frozen=True)
class ActiveVersion:
    """What ``add_versions_active`` did for one adapter."""

    version: VersionInfo
    created: bool  # a new version (False: identical weights were already a live version)
    activated: bool  # the name now serves it and did not before


class VersionBatchMixin:
    """``add_versions_active`` of RegistryService."""

    def _transaction(self) -> AbstractContextManager[Session]:  # provided by RegistryService
        raise NotImplementedError

    def add_versions_active(self, tenant: str, versions: Sequence[NewVersion], *, uploader: str,
                            check_blob: Callable[[str], bool] | None = None) -> list[ActiveVersion]:
        """Add each of ``versions`` (identical weights already live add none) and make it its
        adapter's active version, in one transaction: on any error nothing is written. Names
        must be distinct. ``check_blob(blob_key)`` is called holding the blobs' locks before a
        new row is written, as in ``add_version`` (False: ``BlobMissing``). Operator writes:
        a runtime-loaded adapter among them becomes the operator's (``adapter_origin``)."""
        rows = version_rows(versions, uploader)
        for attempt in range(BATCH_WRITE_ATTEMPTS):
            try:
                return self._add_versions_active_once(tenant, rows, check_blob)
            except IntegrityError:  # another replica created one of these adapters or versions first
                if attempt == BATCH_WRITE_ATTEMPTS - 1:
                    raise Conflict(f"concurrent uploads to tenant {tenant!r}; try again") from None
                time.sleep(random.uniform(0, BATCH_RETRY_BACKOFF_S * 2**attempt))
        raise AssertionError("unreachable")

    def _add_versions_active_once(self, tenant: str, rows: list[VersionRow],
                                  check_blob: Callable[[str], bool] | None) -> list[ActiveVersion]:
        with self._transaction() as session:
            lock_blobs(session, rows)
            tenant_row = self._require_tenant(session, tenant, lock=True)  # type: ignore[attr-defined]
            return self._put_versions_active(session, tenant_row, rows, check_blob)

    def _put_versions_active(self, session: Session, tenant_row: Tenant, rows: list[VersionRow],
                             check_blob: Callable[[str], bool] | None) -> list[ActiveVersion]:
        """``add_versions_active``'s writes in ``session``, which holds the blobs' locks
        (``lock_blobs``) and then the tenant's shared lock. A ``RegistryError`` about one adapter
        carries its name as ``adapter``, for the caller's message."""
        out = []
        for name, fields in rows:
            try:
                before = repo.get_adapter(session, tenant_row, name, for_update=True)
                served_before = before.active_version if before is not None and before.deleted_at is None else None
                check = None if check_blob is None else (lambda key=fields["blob_key"]: check_blob(key))
                version, created = self._put_version(  # type: ignore[attr-defined]
                    session, tenant_row, name, fields, True, check, None)
                adapter = repo.get_adapter(session, tenant_row, name)
                if adapter.active_version != version.version:
                    hot_swap(session, tenant_row.name, adapter, version, uploader=fields["uploader"])
            except RegistryError as exc:
                exc.adapter = name  # type: ignore[attr-defined]
                raise
            out.append(ActiveVersion(version, created, served_before != version.version))
        return out


def version_rows(versions: Sequence[NewVersion], uploader: str) -> list[VersionRow]:
    """``versions`` checked (names valid and distinct, fields as ``version_fields``) as rows."""
    names = [v.name for v in versions]
    for name in names:
        validate_adapter_name(name)
    if len(set(names)) != len(names):
        raise InvalidName("each adapter may be named once in a batch")
    return [(v.name, version_fields(v.sha256, v.base_model, v.rank, v.alpha, v.targets, v.size_bytes,
                                    v.blob_key, uploader)) for v in versions]


def lock_blobs(session: Session, rows: list[VersionRow]) -> None:
    """The blobs' locks of ``rows``, in key order (two replicas starting at once cannot deadlock)."""
    for blob_key in sorted({fields["blob_key"] for _, fields in rows}):
        repo.lock_blob(session, blob_key)


def hot_swap(session: Session, tenant: str, adapter, version: VersionInfo, *, uploader: str) -> None:
    """Point ``adapter`` at ``version`` (a live version of it), as ``RegistryService.activate``."""
    previous = adapter.active_version
    adapter.active_version = version.version
    session.flush()
    repo.bump_change_counter(session)
    repo.add_audit_event(
        session, actor=uploader, action="adapter.activate", tenant=tenant, object_type="adapter",
        object_name=adapter.name, detail={"from": previous, "to": version.version, "sha256": version.sha256},
    )


def version_fields(sha256, base_model, rank, alpha, targets, size_bytes, blob_key, uploader) -> dict[str, Any]:
    """A version row's fields, checked (``RegistryError`` saying which is wrong)."""
    if not isinstance(sha256, str) or not SHA256_HEX.match(sha256):
        raise RegistryError("sha256 must be 64 lower-case hex characters")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise RegistryError(f"rank must be a positive integer, got {rank!r}")
    if isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or size_bytes < 0:
        raise RegistryError(f"size_bytes must be a non-negative integer, got {size_bytes!r}")
    if isinstance(targets, str) or not all(isinstance(t, str) for t in targets):
        raise RegistryError("targets must be a list of module names")
    if not blob_key or not isinstance(blob_key, str):
        raise RegistryError("blob_key must be a non-empty string")
    if not isinstance(base_model, str) or not base_model:
        raise RegistryError("base_model must be a non-empty string")
    return {
        "sha256": sha256,
        "base_model": base_model,
        "rank": rank,
        "alpha": float(alpha),
        "targets": list(targets),
        "size_bytes": size_bytes,
        "blob_key": blob_key,
        "uploader": str(uploader or "unknown"),
    }
