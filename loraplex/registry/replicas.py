"""Which serving replicas are alive, for tenant limits shared by the whole deployment
(``tenant_limits_scope`` "cluster", loraplex/server/cluster_presence.py).

Each replica writes its row of ``replica_heartbeats`` at every registry poll
(``replica_heartbeat``) and reads in the same transaction how many rows are recent: those seen
within ``ttl_seconds``. Rows older than that are deleted on the way (a replica that comes back
writes its row again), so the table holds the live replicas and the few just gone. A replica
that shuts down deletes its own row (``replica_leave``); one that dies stops counting
``ttl_seconds`` after its last heartbeat.

Times are the database's clock (epoch seconds, ``database_seconds``), read in the transaction
that compares them: replicas on machines whose clocks disagree still agree on who is live.
Only a replica writes its own row, so the update-else-insert never races another writer
(a concurrent delete of a stale row is waited for by the update's row lock on PostgreSQL and
serialised by SQLite's write lock, and the insert then follows).
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager

from sqlalchemy import delete, func, insert, select, text, update
from sqlalchemy.orm import Session

from loraplex.registry.errors import InvalidSetting
from loraplex.registry.models import ReplicaHeartbeat

REPLICA_ID_MAX_LENGTH = 64  # ReplicaHeartbeat.replica_id


def database_seconds(session: Session) -> float:
    """The database server's current time in epoch seconds (milliseconds or finer)."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":  # clock_timestamp(): now, not the transaction's start
        return float(session.execute(text("SELECT extract(epoch FROM clock_timestamp())")).scalar_one())
    if dialect == "sqlite":  # julianday('now') keeps milliseconds; 2440587.5 is 1970-01-01
        return float(session.execute(text("SELECT (julianday('now') - 2440587.5) * 86400.0")).scalar_one())
    return time.time()  # another backend: this machine's clock


class ReplicaHeartbeatMixin:
    """Replica heartbeat methods of RegistryService."""

    def _transaction(self) -> AbstractContextManager[Session]:  # provided by RegistryService
        raise NotImplementedError

    def replica_heartbeat(self, replica_id: str, ttl_seconds: float) -> int:
        """Record ``replica_id`` as seen now; forget replicas not seen for ``ttl_seconds``.
        Returns the live replicas, this one included (so at least 1)."""
        _check_replica_id(replica_id)
        if not ttl_seconds > 0:
            raise InvalidSetting(f"ttl_seconds must be positive, got {ttl_seconds!r}", param="ttl_seconds")
        with self._transaction() as session:
            now = database_seconds(session)
            table = ReplicaHeartbeat.__table__
            seen = session.execute(update(table).where(table.c.replica_id == replica_id).values(last_seen=now))
            if seen.rowcount == 0:
                session.execute(insert(table).values(replica_id=replica_id, last_seen=now))
            session.execute(delete(table).where(table.c.last_seen < now - ttl_seconds))
            live = session.execute(select(func.count()).select_from(table)).scalar_one()
        return max(1, int(live))

    def replica_leave(self, replica_id: str) -> None:
        """Delete ``replica_id``'s row: the others stop counting it at their next heartbeat."""
        _check_replica_id(replica_id)
        with self._transaction() as session:
            table = ReplicaHeartbeat.__table__
            session.execute(delete(table).where(table.c.replica_id == replica_id))

    def replicas_seen(self, ttl_seconds: float) -> list[str]:
        """The ids of the replicas seen within ``ttl_seconds``, sorted (for operators and tests)."""
        with self._transaction() as session:
            now = database_seconds(session)
            table = ReplicaHeartbeat.__table__
            rows = session.execute(select(table.c.replica_id).where(table.c.last_seen >= now - ttl_seconds))
            return sorted(r for (r,) in rows)


def _check_replica_id(replica_id: str) -> None:
    if not isinstance(replica_id, str) or not 0 < len(replica_id) <= REPLICA_ID_MAX_LENGTH:
        raise InvalidSetting(f"a replica id is 1 to {REPLICA_ID_MAX_LENGTH} characters, got {replica_id!r}",
                             param="replica_id")
