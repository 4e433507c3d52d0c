"""Alembic environment for the loraplex registry.

The database URL comes from the Config (``loraplex.registry.db.alembic_config`` sets it) or from
``-x url=...`` on the alembic command line; nothing is read from the environment. Logging config
is applied only when run from the command line, so programmatic upgrades leave the host's
logging alone.
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import text

from loraplex.registry.db import make_engine
from loraplex.registry.models import Base

config = context.config
target_metadata = Base.metadata

if config.config_file_name is not None and config.cmd_opts is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database URL: pass -x url=... or use loraplex.registry.db.upgrade(url)")
    return url


def _configure_kwargs(dialect_name: str) -> dict:
    return {
        "target_metadata": target_metadata,
        "compare_type": True,
        # SQLite cannot ALTER most things; batch mode recreates the table instead
        "render_as_batch": dialect_name == "sqlite",
    }


# Several replicas may start at once against one PostgreSQL database: each takes this
# transaction-scoped advisory lock before alembic reads the current revision, so the second one
# waits, then finds the schema already at head.
MIGRATION_LOCK_ID = 0x6C6F7261706C6578  # "loraplex"


def _run_locked(connection) -> None:
    context.configure(connection=connection, **_configure_kwargs(connection.dialect.name))
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": MIGRATION_LOCK_ID})
        context.run_migrations()


def run_migrations_offline() -> None:
    url = _url()
    context.configure(url=url, literal_binds=True, **_configure_kwargs(url.split(":", 1)[0].split("+")[0]))
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run_locked(connection)
        return
    engine = make_engine(_url())
    try:
        with engine.connect() as connection:
            _run_locked(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
