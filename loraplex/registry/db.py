"""Engines, sessions and schema migrations for the registry database.

The URL is always passed in (the entry point reads it from ``Settings.resolved_database_url()``).
``postgresql://`` URLs without a driver are given psycopg (v3), the driver loraplex ships with.
SQLite connections get foreign keys, WAL and a busy timeout so a few threads can share one file.
Migrations live in ``migrations/`` at the repository root (``migrations/alembic.ini`` for the
``alembic`` command line); ``upgrade(url)`` runs them programmatically.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
SQLITE_BUSY_TIMEOUT_MS = 10_000


def normalize_url(url: str) -> str:
    """Give a driverless ``postgresql://`` URL the psycopg driver; leave others unchanged."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def _set_sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
    finally:
        cursor.close()


def make_engine(url: str, **engine_kwargs) -> Engine:
    """An Engine for ``url``; creates the parent directory of a file-backed SQLite database."""
    url = normalize_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:" and not parsed.database.startswith("file:"):
            Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine_kwargs.setdefault("connect_args", {}).setdefault("check_same_thread", False)
        engine = create_engine(url, **engine_kwargs)
        event.listen(engine, "connect", _set_sqlite_pragmas)
        return engine
    engine_kwargs.setdefault("pool_pre_ping", True)
    return create_engine(url, **engine_kwargs)


def make_session_factory(url_or_engine: str | Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded attributes after commit (services convert them to dataclasses)."""
    engine = make_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str, migrations_dir: Path | None = None):
    """An Alembic Config pointing at ``migrations/`` with ``url``; reads no environment."""
    from alembic.config import Config

    directory = Path(migrations_dir or MIGRATIONS_DIR)
    ini = directory / "alembic.ini"
    config = Config(str(ini) if ini.exists() else None)
    config.set_main_option("script_location", str(directory))
    # ConfigParser interpolation: a literal '%' in a password must be doubled
    config.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the database at ``url`` to ``revision`` (creating it if new). Idempotent."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    from alembic import command

    command.downgrade(alembic_config(url), revision)


def current_revision(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()
