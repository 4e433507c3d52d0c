"""Plain frozen dataclasses the registry service hands out (never ORM objects).

``to_dict()`` gives JSON-ready dicts (datetimes as ISO 8601 strings, UTC).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from loraplex.registry.models import VERSION_DELETED, Adapter, AdapterVersion, ApiKey, AuditEvent, Tenant, as_utc
from loraplex.registry.names import format_model_ref


def _jsonable(value: Any) -> Any:
    if isinstance(value, _ToDict):
        return value.to_dict()
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


class _ToDict:
    def to_dict(self) -> dict[str, Any]:
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class TenantInfo(_ToDict):
    """A tenant and its serving limits (``max_concurrent_requests`` None: the server's default;
    a rate limit None: unlimited)."""

    name: str
    created_at: datetime
    max_concurrent_requests: int | None = None
    scheduling_weight: float = 1.0
    max_requests_per_minute: int | None = None
    max_tokens_per_minute: int | None = None

    @classmethod
    def from_row(cls, row: Tenant) -> TenantInfo:
        weight = row.scheduling_weight
        return cls(name=row.name, created_at=as_utc(row.created_at),
                   max_concurrent_requests=row.max_concurrent_requests,
                   scheduling_weight=1.0 if weight is None else float(weight),
                   max_requests_per_minute=row.max_requests_per_minute,
                   max_tokens_per_minute=row.max_tokens_per_minute)


@dataclass(frozen=True)
class ApiKeyInfo(_ToDict):
    """An API key as shown to admins: id and display prefix, never the secret or its hash."""

    id: int
    tenant: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None
    origin: str | None = None  # models.KEY_ORIGIN_SERVE_FLAG for `serve --api-key` keys

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    @classmethod
    def from_row(cls, row: ApiKey, tenant: str) -> ApiKeyInfo:
        return cls(
            id=row.id,
            tenant=tenant,
            prefix=row.prefix,
            created_at=as_utc(row.created_at),
            revoked_at=as_utc(row.revoked_at),
            origin=row.origin,
        )


@dataclass(frozen=True)
class VersionInfo(_ToDict):
    """One immutable adapter version. ``sha256`` is the adapter's identity for every cache."""

    tenant: str
    adapter: str
    version: int
    sha256: str
    base_model: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    size_bytes: int
    blob_key: str
    uploader: str
    created_at: datetime
    state: str
    deleted_at: datetime | None

    @property
    def ref(self) -> str:
        """``name@version``, the reference that always means exactly these weights."""
        return format_model_ref(self.adapter, self.version)

    @property
    def deleted(self) -> bool:
        return self.state == VERSION_DELETED

    @classmethod
    def from_row(cls, row: AdapterVersion, tenant: str, adapter: str) -> VersionInfo:
        return cls(
            tenant=tenant,
            adapter=adapter,
            version=row.number,
            sha256=row.sha256,
            base_model=row.base_model,
            rank=row.rank,
            alpha=row.alpha,
            targets=tuple(row.targets or ()),
            size_bytes=row.size_bytes,
            blob_key=row.blob_key,
            uploader=row.uploader,
            created_at=as_utc(row.created_at),
            state=row.state,
            deleted_at=as_utc(row.deleted_at),
        )


@dataclass(frozen=True)
class AdapterInfo(_ToDict):
    """A named adapter with its live versions (oldest first) and the active version number."""

    tenant: str
    name: str
    active_version: int | None
    versions: tuple[VersionInfo, ...]
    created_at: datetime
    origin: str | None = None  # models.ADAPTER_ORIGIN_RUNTIME for adapters vLLM's load endpoint made

    @property
    def active(self) -> VersionInfo | None:
        return self.version(self.active_version) if self.active_version is not None else None

    def version(self, number: int) -> VersionInfo | None:
        return next((v for v in self.versions if v.version == number), None)

    @classmethod
    def from_row(cls, row: Adapter, tenant: str, versions: list[AdapterVersion]) -> AdapterInfo:
        return cls(
            tenant=tenant,
            name=row.name,
            active_version=row.active_version,
            versions=tuple(VersionInfo.from_row(v, tenant, row.name) for v in versions),
            created_at=as_utc(row.created_at),
            origin=row.origin,
        )


@dataclass(frozen=True)
class AuditEventInfo(_ToDict):
    """One audit record: who (actor) did what (action) to which object, when."""

    id: int
    at: datetime
    actor: str
    action: str
    tenant: str | None
    object_type: str
    object_name: str
    detail: dict[str, Any]

    @classmethod
    def from_row(cls, row: AuditEvent) -> AuditEventInfo:
        return cls(
            id=row.id,
            at=as_utc(row.at),
            actor=row.actor,
            action=row.action,
            tenant=row.tenant,
            object_type=row.object_type,
            object_name=row.object_name,
            detail=dict(row.detail or {}),
        )
