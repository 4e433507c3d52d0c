"""Query and write helpers over a Session. They add, query and flush; they never commit.

Transactions belong to ``service.RegistryService``.
"""

from __future__ import annotations

import hashlib
from typing import Any

from sqlalchemy import func, select, text, update
from sqlalchemy.orm import Session

from loraplex.registry.models import (
    REGISTRY_STATE_ID,
    VERSION_READY,
    Adapter,
    AdapterVersion,
    ApiKey,
    AuditEvent,
    RegistryState,
    Tenant,
)

# ---- tenants -------------------------------------------------------------------------------


def get_tenant(
    session: Session, name: str, *, for_update: bool = False, for_share: bool = False, include_deleted: bool = False
) -> Tenant | None:
    """The live tenant of that name (with ``include_deleted``, its tombstone too). A row lock
    re-checks ``deleted_at`` on PostgreSQL once the lock is granted, so a writer that waited on a
    tenant delete finds no tenant; on SQLite a lock is ``serialise_writer`` (so: a first read)."""
    if for_update or for_share:
        serialise_writer(session)
    query = select(Tenant).where(Tenant.name == name)
    if not include_deleted:
        query = query.where(Tenant.deleted_at.is_(None))
    if for_update or for_share:
        query = query.with_for_update(read=not for_update)
    return session.scalars(query).one_or_none()


def lock_tenant(session: Session, name: str, *, exclusive: bool) -> Tenant | None:
    """The live tenant, locked until the transaction ends against a tenant delete (``exclusive``:
    the delete itself; shared: writers adding keys or versions to it). PostgreSQL: ``FOR UPDATE``
    / ``FOR SHARE``. SQLite has no row locks: the database's write lock is taken first (as
    ``lock_blob`` does), so what is read afterwards is current. Call it before other reads."""
    return get_tenant(session, name, for_update=exclusive, for_share=not exclusive)


def serialise_writer(session: Session) -> None:
    """Before the first read of a transaction that reads, checks, then writes (a row read
    ``for_update``): SQLite has no row locks, so the database's one write lock is taken now
    (waiting up to the busy timeout) and what is read afterwards is current; without it two
    such writers both passed their checks (a hot-swap to a version being deleted: both
    committed). PostgreSQL: nothing, the query's row lock serialises them per row."""
    if session.get_bind().dialect.name != "postgresql":
        _take_sqlite_write_lock(session)


def list_tenants(session: Session) -> list[Tenant]:
    """Live tenants, by name."""
    return list(session.scalars(select(Tenant).where(Tenant.deleted_at.is_(None)).order_by(Tenant.name)))


def add_tenant(session: Session, name: str) -> Tenant:
    tenant = Tenant(name=name)
    session.add(tenant)
    session.flush()
    return tenant


# ---- API keys ------------------------------------------------------------------------------


def add_api_key(session: Session, tenant: Tenant, secret_sha256: str, prefix: str, origin: str | None = None) -> ApiKey:
    key = ApiKey(tenant=tenant, secret_sha256=secret_sha256, prefix=prefix, origin=origin)
    session.add(key)
    session.flush()
    return key


def list_api_keys(session: Session, tenant: Tenant) -> list[ApiKey]:
    return list(session.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant.id).order_by(ApiKey.id)))


def get_api_key(session: Session, tenant: Tenant, key_id: int) -> ApiKey | None:
    return session.scalars(
        select(ApiKey).where(ApiKey.tenant_id == tenant.id, ApiKey.id == key_id)
    ).one_or_none()


def live_api_keys_of_origin(session: Session, origin: str) -> list[tuple[ApiKey, str]]:
    """Unrevoked keys of that origin, any tenant, with their tenant's name."""
    rows = session.execute(
        select(ApiKey, Tenant.name).join(Tenant)
        .where(ApiKey.origin == origin, ApiKey.revoked_at.is_(None)).order_by(ApiKey.id)
    )
    return [(row[0], row[1]) for row in rows]


def find_api_key_by_hash(
    session: Session, secret_sha256: str, *, live_tenant_only: bool = False
) -> tuple[ApiKey, str] | None:
    """The key with that secret hash and its tenant's name (with ``live_tenant_only``, None
    when that tenant was deleted)."""
    query = select(ApiKey, Tenant.name).join(Tenant).where(ApiKey.secret_sha256 == secret_sha256)
    if live_tenant_only:
        query = query.where(Tenant.deleted_at.is_(None))
    row = session.execute(query).one_or_none()
    return None if row is None else (row[0], row[1])


# ---- adapters and versions -----------------------------------------------------------------


def get_adapter(session: Session, tenant: Tenant, name: str, *, for_update: bool = False) -> Adapter | None:
    """The adapter row (deleted ones included: callers check ``deleted_at``); ``for_update``
    in a transaction that called ``serialise_writer`` first."""
    query = select(Adapter).where(Adapter.tenant_id == tenant.id, Adapter.name == name)
    if for_update:
        query = query.with_for_update()
    return session.scalars(query).one_or_none()


def list_adapters(session: Session, tenant: Tenant, *, for_update: bool = False) -> list[Adapter]:
    """Live adapters of a tenant, by name."""
    query = select(Adapter).where(Adapter.tenant_id == tenant.id, Adapter.deleted_at.is_(None)).order_by(Adapter.name)
    if for_update:
        query = query.with_for_update()
    return list(session.scalars(query))


def add_adapter(session: Session, tenant: Tenant, name: str, origin: str | None = None) -> Adapter:
    adapter = Adapter(tenant=tenant, name=name, origin=origin)
    session.add(adapter)
    session.flush()
    return adapter


def live_versions(session: Session, adapter: Adapter) -> list[AdapterVersion]:
    return list(
        session.scalars(
            select(AdapterVersion)
            .where(AdapterVersion.adapter_id == adapter.id, AdapterVersion.state == VERSION_READY)
            .order_by(AdapterVersion.number)
        )
    )


def live_versions_of(session: Session, adapters: list[Adapter]) -> dict[int, list[AdapterVersion]]:
    """Live versions of several adapters in one query, keyed by adapter id."""
    by_adapter: dict[int, list[AdapterVersion]] = {adapter.id: [] for adapter in adapters}
    if not adapters:
        return by_adapter
    rows = session.scalars(
        select(AdapterVersion)
        .where(AdapterVersion.adapter_id.in_(by_adapter), AdapterVersion.state == VERSION_READY)
        .order_by(AdapterVersion.adapter_id, AdapterVersion.number)
    )
    for version in rows:
        by_adapter[version.adapter_id].append(version)
    return by_adapter


def get_version(session: Session, adapter: Adapter, number: int) -> AdapterVersion | None:
    """A version by number, deleted tombstones included."""
    return session.scalars(
        select(AdapterVersion).where(AdapterVersion.adapter_id == adapter.id, AdapterVersion.number == number)
    ).one_or_none()


def find_live_version_by_sha(session: Session, adapter: Adapter, sha256: str) -> AdapterVersion | None:
    return session.scalars(
        select(AdapterVersion)
        .where(
            AdapterVersion.adapter_id == adapter.id,
            AdapterVersion.sha256 == sha256,
            AdapterVersion.state == VERSION_READY,
        )
        .order_by(AdapterVersion.number)
        .limit(1)
    ).one_or_none()


def next_version_number(session: Session, adapter: Adapter) -> int:
    """One past the highest number ever used (tombstones count, so numbers are never reused)."""
    highest = session.scalar(
        select(func.max(AdapterVersion.number)).where(AdapterVersion.adapter_id == adapter.id)
    )
    return (highest or 0) + 1


def add_version(session: Session, adapter: Adapter, number: int, **fields: Any) -> AdapterVersion:
    version = AdapterVersion(adapter=adapter, number=number, **fields)
    session.add(version)
    session.flush()
    return version


def shas_without_live_version(session: Session, shas: list[str]) -> set[str]:
    """Of ``shas``, those some version row has and no live one: weights that were deleted."""
    known, live = set(), set()
    for sha, state in session.execute(select(AdapterVersion.sha256, AdapterVersion.state)
                                      .where(AdapterVersion.sha256.in_(shas))):
        known.add(sha)
        if state == VERSION_READY:
            live.add(sha)
    return known - live


def count_live_versions_with_blob(session: Session, blob_key: str) -> int:
    return session.scalar(
        select(func.count())
        .select_from(AdapterVersion)
        .where(AdapterVersion.blob_key == blob_key, AdapterVersion.state == VERSION_READY)
    ) or 0


def lock_blob(session: Session, blob_key: str) -> None:
    """Take, until the transaction ends, the lock that serialises "count the live versions using
    ``blob_key``, then delete the blob" against "add a version row using ``blob_key``", across
    threads and processes sharing the database.

    PostgreSQL: a transaction-level advisory lock keyed by the blob key (a 64-bit hash of it; a
    collision only serialises two unrelated blobs). It is released after the commit is visible,
    so a READ COMMITTED statement run after acquiring it sees every row its previous holder wrote.

    SQLite (and any other backend): a write to the single ``registry_state`` row. On SQLite any
    write takes the database's one write lock until commit (waiting up to the busy timeout), so
    this serialises against every writer, the version insert included; elsewhere it is a row
    lock on that row. Call it first in the transaction, before any read, so what the
    transaction reads afterwards is current.
    """
    if session.get_bind().dialect.name == "postgresql":
        session.execute(
            text("SELECT pg_advisory_xact_lock(CAST(:lock_id AS BIGINT))"), {"lock_id": blob_lock_id(blob_key)}
        )
        return
    _take_sqlite_write_lock(session)


def _take_sqlite_write_lock(session: Session) -> None:
    """A no-op write to the ``registry_state`` row: on SQLite it takes the database's one write
    lock until commit (waiting up to the busy timeout); elsewhere a row lock on that row."""
    session.execute(
        update(RegistryState)
        .where(RegistryState.id == REGISTRY_STATE_ID)
        .values(change_counter=RegistryState.change_counter)
        .execution_options(synchronize_session=False)
    )


def blob_lock_id(blob_key: str) -> int:
    """The signed 64-bit PostgreSQL advisory lock id of a blob key."""
    digest = hashlib.sha256(b"loraplex.blob:" + blob_key.encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


# ---- audit and state -----------------------------------------------------------------------


def add_audit_event(
    session: Session,
    *,
    actor: str,
    action: str,
    tenant: str | None,
    object_type: str,
    object_name: str,
    detail: dict[str, Any] | None = None,
) -> AuditEvent:
    event = AuditEvent(
        actor=actor,
        action=action,
        tenant=tenant,
        object_type=object_type,
        object_name=object_name,
        detail=dict(detail or {}),
    )
    session.add(event)
    session.flush()
    return event


def list_audit_events(session: Session, tenant: str | None, limit: int) -> list[AuditEvent]:
    """Newest first."""
    query = select(AuditEvent).order_by(AuditEvent.id.desc()).limit(limit)
    if tenant is not None:
        query = query.where(AuditEvent.tenant == tenant)
    return list(session.scalars(query))


def get_state(session: Session) -> RegistryState:
    """The single state row, created if a database was built without the migration's seed row."""
    state = session.get(RegistryState, REGISTRY_STATE_ID)
    if state is None:
        state = RegistryState(id=REGISTRY_STATE_ID, change_counter=0)
        session.add(state)
        session.flush()
    return state


def bump_change_counter(session: Session) -> None:
    """Increment in SQL (not read-modify-write) so concurrent writers never lose a bump."""
    get_state(session)
    session.execute(
        update(RegistryState)
        .where(RegistryState.id == REGISTRY_STATE_ID)
        .values(change_counter=RegistryState.change_counter + 1)
        .execution_options(synchronize_session=False)
    )
    session.flush()


def read_change_counter(session: Session) -> int:
    return session.scalar(
        select(RegistryState.change_counter).where(RegistryState.id == REGISTRY_STATE_ID)
    ) or 0
