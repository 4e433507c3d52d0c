"""Alembic: upgrade -> no autogenerate diff -> downgrade one -> upgrade, on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect

from loraplex.registry import db
from loraplex.registry.models import NAMING_CONVENTION, Base


def _diff(url: str) -> list:
    engine = db.make_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True, "compare_server_default": True})
            return compare_metadata(context, Base.metadata)
    finally:
        engine.dispose()


def _tables(url: str) -> set[str]:
    engine = db.make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_check_downgrade_upgrade(database_url):
    head = ScriptDirectory.from_config(db.alembic_config(database_url)).get_current_head()
    model_tables = set(Base.metadata.tables)

    db.upgrade(database_url)
    assert db.current_revision(database_url) == head
    assert model_tables <= _tables(database_url)
    assert _diff(database_url) == []

    db.downgrade(database_url, "-1")
    assert db.current_revision(database_url) != head
    if db.current_revision(database_url) is None:  # downgraded past the initial revision
        assert not model_tables & _tables(database_url)
    assert _diff(database_url), "the autogenerate check must see a schema that is behind the models"

    db.upgrade(database_url)
    assert db.current_revision(database_url) == head
    assert _diff(database_url) == []
    db.upgrade(database_url)  # idempotent
    assert db.current_revision(database_url) == head


def test_every_constraint_and_index_is_named_by_the_convention(registry_url):
    engine = db.make_engine(registry_url)
    try:
        inspector = inspect(engine)
        is_postgres = engine.dialect.name == "postgresql"
        for table in Base.metadata.tables:
            pk = inspector.get_pk_constraint(table)
            if is_postgres:  # SQLite does not keep primary key names
                assert pk["name"] == f"pk_{table}"
            for fk in inspector.get_foreign_keys(table):
                assert fk["name"] and fk["name"].startswith(f"fk_{table}_"), fk
            for uq in inspector.get_unique_constraints(table):
                assert uq["name"] == f"uq_{table}_" + "_".join(uq["column_names"]), uq
            for index in inspector.get_indexes(table):
                if index.get("duplicates_constraint"):  # PostgreSQL's index behind a UNIQUE
                    continue
                assert index["name"] == f"ix_{table}_" + "_".join(index["column_names"]), index
    finally:
        engine.dispose()
    # the metadata itself: every constraint object has a name derived from the convention
    assert set(NAMING_CONVENTION) == {"ix", "uq", "ck", "fk", "pk"}
    for table in Base.metadata.sorted_tables:
        for constraint in table.constraints:
            assert constraint.name, (table.name, constraint)


def test_migration_seeds_the_state_row(registry_service):
    assert registry_service.change_counter() == 0
    assert registry_service.admin_key_hash() is None


def test_alembic_command_line_uses_migrations_ini(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    repo_root = Path(__file__).resolve().parents[2]
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    result = subprocess.run(
        [sys.executable, "-m", "alembic", "-c", "migrations/alembic.ini", "-x", f"url={url}", "upgrade", "head"],
        cwd=repo_root, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert db.current_revision(url) == ScriptDirectory.from_config(db.alembic_config(url)).get_current_head()


@pytest.mark.slow
@pytest.mark.postgres
def test_replicas_upgrading_at_once_do_not_collide(pg_url):
    """Replica processes migrating one PostgreSQL database together (advisory lock in env.py)."""
    import subprocess
    import sys
    from pathlib import Path

    code = "import sys; from loraplex.registry.db import upgrade; upgrade(sys.argv[1])"
    repo_root = Path(__file__).resolve().parents[2]
    procs = [
        subprocess.Popen([sys.executable, "-c", code, pg_url], cwd=repo_root, stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errors
    assert _diff(pg_url) == []
