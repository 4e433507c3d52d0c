"""SQLAlchemy 2 models of the registry: tenants, API keys, adapters, versions, audit, state, usage.

Every constraint and index is named through ``NAMING_CONVENTION`` so migrations can refer to
them on every backend. Timestamps are stored timezone-aware (UTC); SQLite hands them back
naive, so readers go through ``as_utc``.

Versions are never updated except for the soft-delete fields: a deleted version stays as a
tombstone so that its number is never reused (``name@3`` always meant the same weights).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

NAME_LENGTH = 63
SHA256_HEX_LENGTH = 64

VERSION_READY = "ready"
VERSION_DELETED = "deleted"
REGISTRY_STATE_ID = 1  # registry_state has exactly one row
# ApiKey.origin of a key ``loraplex serve --api-key`` stored (vLLM's flag); None: made by loraplex
# (admin API, ``loraplex tenants create-key``, the demo tenant), which start-up never touches
KEY_ORIGIN_SERVE_FLAG = "serve_flag"
# Adapter.origin of an adapter a tenant key created with ``POST /v1/load_lora_adapter`` (vLLM's
# runtime endpoint), which that tenant's keys may replace and unload; None: the operator's (admin
# API, CLI, ``serve --lora-modules``), which the runtime endpoints never change
ADAPTER_ORIGIN_RUNTIME = "runtime_load"


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def as_utc(value: datetime | None) -> datetime | None:
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=timezone.utc)


class Base(DeclarativeBase):
    """Declarative base carrying the named-constraint metadata."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dict[str, Any]: JSON, list[str]: JSON, datetime: DateTime(timezone=True)}


class Tenant(Base):
    """A tenant: owns adapters and API keys, and carries its operator-set serving limits.
    A deleted tenant is a tombstone (``deleted_at`` set): its name stays taken for good."""

    __tablename__ = "tenant"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LENGTH), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # requests in flight at once on one replica; None: the server's own default
    max_concurrent_requests: Mapped[int | None] = mapped_column(Integer, default=None)
    # share under the "fair" scheduling policy; a server default so rows from before the column get 1
    scheduling_weight: Mapped[float] = mapped_column(Float, default=1.0, server_default=text("1"))
    # OpenAI-style rate limits, per replica; None: unlimited
    max_requests_per_minute: Mapped[int | None] = mapped_column(Integer, default=None)
    max_tokens_per_minute: Mapped[int | None] = mapped_column(Integer, default=None)
    # set when the tenant is deleted (tenant_delete.py): the row stays so the name is never reused
    deleted_at: Mapped[datetime | None] = mapped_column(default=None)

    api_keys: Mapped[list[ApiKey]] = relationship(back_populates="tenant")
    adapters: Mapped[list[Adapter]] = relationship(back_populates="tenant")


class ApiKey(Base):
    """A tenant API key. Only the sha256 of the secret is stored; ``prefix`` is for display.
    ``origin`` says who manages the key (``KEY_ORIGIN_SERVE_FLAG``, or None for loraplex's own)."""

    __tablename__ = "api_key"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenant.id", ondelete="CASCADE"), index=True)
    secret_sha256: Mapped[str] = mapped_column(String(SHA256_HEX_LENGTH), unique=True)
    prefix: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)
    origin: Mapped[str | None] = mapped_column(String(16), default=None)

    tenant: Mapped[Tenant] = relationship(back_populates="api_keys")


class Adapter(Base):
    """A named adapter of a tenant; ``active_version`` is the number ``name`` resolves to.
    ``origin`` says who manages it (``ADAPTER_ORIGIN_RUNTIME``, or None for the operator)."""

    __tablename__ = "adapter"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenant.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(NAME_LENGTH))
    active_version: Mapped[int | None] = mapped_column(Integer, default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # set when the whole adapter is deleted; a later upload under the same name revives it and
    # continues its version numbering
    deleted_at: Mapped[datetime | None] = mapped_column(default=None)
    origin: Mapped[str | None] = mapped_column(String(16), default=None)

    tenant: Mapped[Tenant] = relationship(back_populates="adapters")
    versions: Mapped[list[AdapterVersion]] = relationship(
        back_populates="adapter", order_by="AdapterVersion.number"
    )


class AdapterVersion(Base):
    """One immutable upload of an adapter: numbered 1, 2, 3... per adapter."""

    __tablename__ = "adapter_version"
    __table_args__ = (
        UniqueConstraint("adapter_id", "number"),
        Index(None, "blob_key"),
        Index(None, "adapter_id", "sha256"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    adapter_id: Mapped[int] = mapped_column(ForeignKey("adapter.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(SHA256_HEX_LENGTH))
    base_model: Mapped[str] = mapped_column(String(255))
    rank: Mapped[int] = mapped_column(Integer)
    alpha: Mapped[float] = mapped_column(Float)
    targets: Mapped[list[str]] = mapped_column()
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    blob_key: Mapped[str] = mapped_column(String(512))
    uploader: Mapped[str] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    state: Mapped[str] = mapped_column(String(16), default=VERSION_READY)
    deleted_at: Mapped[datetime | None] = mapped_column(default=None)

    adapter: Mapped[Adapter] = relationship(back_populates="versions")


class AuditEvent(Base):
    """Who did what to which object, when. Names are copied, not referenced, so events outlive objects."""

    __tablename__ = "audit_event"
    __table_args__ = (Index(None, "tenant", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(default=utcnow)
    actor: Mapped[str] = mapped_column(String(255))
    action: Mapped[str] = mapped_column(String(64))
    tenant: Mapped[str | None] = mapped_column(String(NAME_LENGTH), default=None)
    object_type: Mapped[str] = mapped_column(String(32))
    object_name: Mapped[str] = mapped_column(String(255))
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)


class RegistryState(Base):
    """Single row: a change counter bumped with every hot-swap/delete, and the admin key hash."""

    __tablename__ = "registry_state"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    change_counter: Mapped[int] = mapped_column(BigInteger, default=0)
    admin_key_sha256: Mapped[str | None] = mapped_column(String(SHA256_HEX_LENGTH), default=None)


# UsageHour.adapter of requests to the base model: a real value, not NULL, because SQL unique
# keys treat NULLs as distinct and the additive upsert needs the key to conflict. Adapter names
# are never empty (names.validate_name), so it cannot mean an adapter.
BASE_MODEL_ADAPTER = ""


class UsageHour(Base):
    """What one tenant used of one adapter (or the base model) in one UTC hour, for billing.

    Keyed by names, not ids, and without foreign keys: usage outlives the tenant and adapter it
    counts (an adapter deleted or re-created under the same name keeps its history). Rows only
    grow by additive upserts (``usage.UsageMixin.record_usage``). ``requests`` and the token
    columns count answered requests (status 200) exactly as their ``usage`` reported them; the
    ``failed_`` columns count admitted requests that ended otherwise (client gone, engine
    error), with the prompt tokens and the completion tokens generated before they ended.
    """

    __tablename__ = "usage_hourly"
    __table_args__ = (Index(None, "hour"),)

    tenant: Mapped[str] = mapped_column(String(NAME_LENGTH), primary_key=True)
    adapter: Mapped[str] = mapped_column(String(NAME_LENGTH), primary_key=True)
    hour: Mapped[datetime] = mapped_column(primary_key=True)  # start of the UTC hour the request finished in
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    failed_requests: Mapped[int] = mapped_column(BigInteger, default=0)
    failed_prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    failed_completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)


class UsageFlush(Base):
    """One usage batch already added to ``usage_hourly``: a retry of a batch whose commit was
    not acknowledged finds its id here and adds nothing (``usage.UsageMixin.record_usage``).
    Rows older than ``usage.FLUSH_ID_RETENTION`` are pruned by later batches."""

    __tablename__ = "usage_flushes"
    __table_args__ = (Index(None, "flushed_at"),)

    batch_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    flushed_at: Mapped[datetime] = mapped_column(default=utcnow)


class ReplicaHeartbeat(Base):
    """A serving replica that counts itself in the cluster-wide tenant limits
    (``tenant_limits_scope`` "cluster"): it writes ``last_seen`` every registry poll and is
    counted while that is recent (``replicas.ReplicaHeartbeatMixin``). ``last_seen`` is the
    database's own clock in epoch seconds, so replicas' clocks never have to agree."""

    __tablename__ = "replica_heartbeats"
    __table_args__ = (Index(None, "last_seen"),)

    replica_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    last_seen: Mapped[float] = mapped_column(Float)
