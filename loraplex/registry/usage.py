"""Usage accounting: requests and tokens per tenant, adapter and UTC hour (``models.UsageHour``).

Servers add what their finished requests used with ``record_usage``, a batch at a time; every
row is an upsert that *adds* (``INSERT ... ON CONFLICT DO UPDATE SET n = n + excluded.n``), so
replicas sharing the database may write the same rows at once and the sums stay exact. A batch
is one transaction: it lands whole or not at all. A batch sent with an id records the id in
``usage_flushes`` in that transaction, and a batch whose id is there already adds nothing: a
caller that saw a write fail (even after the database committed it, the acknowledgement lost
with the connection) sends the same batch with the same id again and nothing is counted twice.
Ids older than ``FLUSH_ID_RETENTION`` are pruned by later batches. Rows are written in key
order, so two replicas' batches take row locks in the same order and cannot deadlock on
PostgreSQL.

``usage_report`` reads them back for a period (``start`` inclusive, ``end`` exclusive, both on
the hour, UTC) with optional filters and grouping by tenant, adapter, hour or day. In reports
the base model's adapter is None (stored as ``models.BASE_MODEL_ADAPTER``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import ColumnElement, delete, func, select
from sqlalchemy.exc import DataError, IntegrityError, OperationalError
from sqlalchemy.orm import Session

from loraplex.registry.errors import InvalidSetting
from loraplex.registry.models import BASE_MODEL_ADAPTER, UsageFlush, UsageHour, as_utc, utcnow
from loraplex.registry.names import validate_adapter_name, validate_tenant_name

COUNTERS = ("requests", "prompt_tokens", "completion_tokens",
            "failed_requests", "failed_prompt_tokens", "failed_completion_tokens")
GROUP_KEYS = ("tenant", "adapter", "hour", "day")
# a batch that lost to a lock (SQLite's busy timeout ran out, a PostgreSQL deadlock or
# serialization failure) is retried whole; the recorder's next flush retries again after these
USAGE_WRITE_ATTEMPTS = 4
USAGE_RETRY_BACKOFF_S = 0.01
# how long a batch id is remembered: far longer than any retry of it (a recorder resends an
# unacknowledged batch at its next flushes, backing off to a minute or so)
FLUSH_ID_RETENTION = timedelta(days=7)
BATCH_ID_MAX_LENGTH = 64  # UsageFlush.batch_id


@dataclass(frozen=True)
class UsageDelta:
    """Counts to add to one (tenant, adapter, hour) row; ``adapter`` None is the base model."""

    tenant: str
    adapter: str | None
    hour: datetime  # start of a UTC hour (``hour_of``)
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    failed_requests: int = 0
    failed_prompt_tokens: int = 0
    failed_completion_tokens: int = 0

    def counts(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in COUNTERS}


@dataclass(frozen=True)
class UsageReport:
    """Rows of a usage query (group keys, then the counters) and their totals."""

    start: datetime | None
    end: datetime | None
    group_by: tuple[str, ...]
    rows: list[dict[str, Any]] = field(default_factory=list)
    totals: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "object": "usage",
            "start": _iso(self.start),
            "end": _iso(self.end),
            "group_by": list(self.group_by),
            "data": self.rows,
            "totals": self.totals,
        }


def hour_of(moment: float | datetime) -> datetime:
    """The start of the UTC hour holding ``moment`` (a Unix time or an aware datetime)."""
    if not isinstance(moment, datetime):
        moment = datetime.fromtimestamp(moment, timezone.utc)
    return moment.astimezone(timezone.utc).replace(minute=0, second=0, microsecond=0)


def parse_hour(text: str, param: str) -> datetime:
    """An ISO 8601 date or date-time on the hour (``2026-12-03``, ``2026-12-03T14``,
    ``2026-12-03T14:00:00Z``, ``...+01:00``), as an aware UTC datetime; no offset means UTC.
    Anything else is InvalidSetting naming ``param``: a period cut inside an hour could not be
    answered from hourly rows, and rounding it would bill an hour twice or not at all."""
    example = "like 2026-12-03T14:00:00Z"
    try:
        value = datetime.fromisoformat(text.strip())
        value = (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).astimezone(timezone.utc)
    except (ValueError, OverflowError, AttributeError):
        raise InvalidSetting(f"`{param}` must be an ISO 8601 date or time, {example}; got {text!r}",
                             param=param) from None
    if value.minute or value.second or value.microsecond:
        raise InvalidSetting(f"`{param}` must be on the hour (usage is kept per hour), {example}; got {text!r}",
                             param=param)
    return value


def parse_group_by(values: Iterable[str]) -> tuple[str, ...]:
    """Group keys from ``values`` (each may hold several, comma-separated), in the order given."""
    keys: list[str] = []
    for value in values:
        for key in (k.strip() for k in value.split(",")):
            if not key:
                continue
            if key not in GROUP_KEYS:
                raise InvalidSetting(f"`group_by` takes {', '.join(GROUP_KEYS)} (comma-separated); got {key!r}",
                                     param="group_by")
            if key not in keys:
                keys.append(key)
    if "hour" in keys and "day" in keys:
        raise InvalidSetting("`group_by` takes hour or day, not both", param="group_by")
    return tuple(keys)


class UsageMixin:
    """Usage accounting methods of RegistryService."""

    def _transaction(self) -> AbstractContextManager[Session]:  # provided by RegistryService
        raise NotImplementedError

    def record_usage(self, deltas: Sequence[UsageDelta], batch_id: str | None = None) -> bool:
        """Add ``deltas`` to their rows in one transaction (all or nothing); True when added,
        False when ``batch_id`` was recorded already (a resent batch: nothing added). Several
        replicas may call this at once for the same rows, each with its own batch ids. Raises
        InvalidSetting for a malformed delta or id, and the database's own error when it is
        down or refuses a value (``is_permanent_usage_error`` tells the two apart); unless the
        commit's acknowledgement was lost, nothing was added."""
        rows = _merged_rows(deltas)
        if batch_id is not None and (not isinstance(batch_id, str) or not 0 < len(batch_id) <= BATCH_ID_MAX_LENGTH):
            raise InvalidSetting(f"a usage batch id is 1 to {BATCH_ID_MAX_LENGTH} characters", param="batch_id")
        if not rows:
            return True
        for attempt in range(USAGE_WRITE_ATTEMPTS):
            try:
                with self._transaction() as session:
                    if batch_id is not None and not _claim_batch(session, batch_id):
                        return False
                    session.execute(_upsert(session), rows)
                return True
            except (OperationalError, IntegrityError) as exc:
                # a lost lock race, or this batch id's row taken meanwhile (then the retry sees it)
                if attempt == USAGE_WRITE_ATTEMPTS - 1:
                    raise exc
                time.sleep(random.uniform(0, USAGE_RETRY_BACKOFF_S * 2**attempt))
        raise AssertionError("unreachable")

    def usage_report(
        self,
        *,
        tenant: str | None = None,
        adapter: str | None = None,
        start: datetime | None = None,
        end: datetime | None = None,
        group_by: Sequence[str] = (),
    ) -> UsageReport:
        """Sums over ``[start, end)`` (each None: unbounded), of one tenant and/or one adapter
        name when given, one row per combination of ``group_by`` keys that has usage (one row
        in all without grouping), sorted by those keys. Raises InvalidSetting (with ``param``)
        or InvalidName for bad arguments."""
        if tenant is not None:
            validate_tenant_name(tenant)
        if adapter is not None:
            validate_adapter_name(adapter)
        group_by = parse_group_by(group_by)
        for name, value in (("start", start), ("end", end)):
            if value is not None and (value.tzinfo is None or hour_of(value) != value):
                raise InvalidSetting(f"`{name}` must be an aware datetime on the hour", param=name)
        if start is not None and end is not None and end < start:
            raise InvalidSetting("`end` is before `start`", param="end")
        # SQLite keeps the hour as UTC wall-clock text and binds a datetime's own wall clock,
        # offset dropped: a bound in another zone must be converted, or it filters by the offset
        start, end = (None if v is None else v.astimezone(timezone.utc) for v in (start, end))
        with self._transaction() as session:
            keys = {key: _group_column(session, key) for key in group_by}
            sums = [func.coalesce(func.sum(getattr(UsageHour, c)), 0).label(c) for c in COUNTERS]
            query = select(*(col.label(key) for key, col in keys.items()), *sums)
            if tenant is not None:
                query = query.where(UsageHour.tenant == tenant)
            if adapter is not None:
                query = query.where(UsageHour.adapter == adapter)
            if start is not None:
                query = query.where(UsageHour.hour >= start)
            if end is not None:
                query = query.where(UsageHour.hour < end)
            if keys:
                query = query.group_by(*keys.values()).order_by(*keys.values())
            results = session.execute(query).all()
        rows = [_row_dict(result, group_by) for result in results]
        rows = [row for row in rows if row["requests"] or row["failed_requests"]]
        totals = {c: sum(row[c] for row in rows) for c in COUNTERS}
        totals["total_tokens"] = totals["prompt_tokens"] + totals["completion_tokens"]
        return UsageReport(start=start, end=end, group_by=group_by, rows=rows, totals=totals)


def is_permanent_usage_error(exc: BaseException) -> bool:
    """Whether sending the same usage batch again cannot succeed: the database refused one of
    its values (a constraint, a value out of range) or the batch is malformed. Anything else (a
    connection lost or refused, a lock lost, a table not migrated yet) may pass later."""
    return isinstance(exc, (IntegrityError, DataError, ValueError, TypeError, OverflowError))


def _claim_batch(session: Session, batch_id: str) -> bool:
    """Record ``batch_id`` in this transaction; False when it was recorded before. Prunes ids
    past ``FLUSH_ID_RETENTION``."""
    if session.get(UsageFlush, batch_id) is not None:
        return False
    now = utcnow()
    session.execute(delete(UsageFlush).where(UsageFlush.flushed_at < now - FLUSH_ID_RETENTION))
    session.add(UsageFlush(batch_id=batch_id, flushed_at=now))
    session.flush()  # a concurrent claim of the same id fails here, before the counts are added
    return True


def _merged_rows(deltas: Sequence[UsageDelta]) -> list[dict[str, Any]]:
    """One parameter set per row key (an INSERT may not name one row twice), sorted by key."""
    merged: dict[tuple, dict[str, Any]] = {}
    for delta in deltas:
        for name in COUNTERS:
            value = getattr(delta, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidSetting(f"usage {name} must be a non-negative integer, got {value!r}", param=name)
        hour = hour_of(delta.hour)
        key = (delta.tenant, delta.adapter or BASE_MODEL_ADAPTER, hour)
        row = merged.setdefault(key, {"tenant": key[0], "adapter": key[1], "hour": hour,
                                      **{c: 0 for c in COUNTERS}})
        for name in COUNTERS:
            row[name] += getattr(delta, name)
    return [merged[key] for key in sorted(merged)]


def _upsert(session: Session):
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:  # pragma: no cover - loraplex runs on these two
        raise NotImplementedError(f"usage accounting needs SQLite or PostgreSQL, not {dialect}")
    table = UsageHour.__table__
    stmt = insert(table)
    return stmt.on_conflict_do_update(
        index_elements=[table.c.tenant, table.c.adapter, table.c.hour],
        set_={c: table.c[c] + stmt.excluded[c] for c in COUNTERS},
    )


def _group_column(session: Session, key: str) -> ColumnElement:
    if key != "day":
        return getattr(UsageHour, key)
    if session.get_bind().dialect.name == "postgresql":
        return func.to_char(func.timezone("UTC", UsageHour.hour), "YYYY-MM-DD")
    # SQLite keeps the UTC time as text, 'YYYY-MM-DD HH:MM:SS.ffffff'
    return func.substr(UsageHour.hour, 1, 10)


def _row_dict(result, group_by: tuple[str, ...]) -> dict[str, Any]:
    mapping = result._mapping
    row: dict[str, Any] = {}
    for key in group_by:
        value = mapping[key]
        if key == "adapter":
            value = value or None  # BASE_MODEL_ADAPTER
        elif key == "hour":
            value = _iso(as_utc(value))
        elif key == "day":
            value = str(value)
        row[key] = value
    for name in COUNTERS:
        row[name] = int(mapping[name])
    row["total_tokens"] = row["prompt_tokens"] + row["completion_tokens"]
    return row


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


__all__ = ["COUNTERS", "FLUSH_ID_RETENTION", "GROUP_KEYS", "UsageDelta", "UsageMixin", "UsageReport", "hour_of",
           "is_permanent_usage_error", "parse_group_by", "parse_hour"]
