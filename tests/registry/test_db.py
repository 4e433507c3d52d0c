"""Engine setup: URL normalisation, SQLite pragmas and directory creation, readiness ping."""

from __future__ import annotations

import socket

from sqlalchemy import text

from loraplex.registry import db
from loraplex.registry.service import RegistryService


def test_driverless_postgres_urls_get_psycopg():
    assert db.normalize_url("postgresql://u:p@h:5/d") == "postgresql+psycopg://u:p@h:5/d"
    assert db.normalize_url("postgres://u@h/d") == "postgresql+psycopg://u@h/d"
    assert db.normalize_url("postgresql+psycopg://u@h/d") == "postgresql+psycopg://u@h/d"
    assert db.normalize_url("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"


def test_sqlite_gets_its_directory_and_pragmas(tmp_path):
    path = tmp_path / "deep" / "home" / "loraplex.db"
    engine = db.make_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert conn.execute(text("PRAGMA busy_timeout")).scalar() == db.SQLITE_BUSY_TIMEOUT_MS
    finally:
        engine.dispose()
    assert path.exists()


def test_foreign_keys_are_enforced(registry_url):
    import pytest
    from sqlalchemy.exc import IntegrityError

    engine = db.make_engine(registry_url)
    try:
        with pytest.raises(IntegrityError), engine.begin() as conn:
            conn.execute(text("INSERT INTO adapter (tenant_id, name, created_at) VALUES (999, 'x', CURRENT_TIMESTAMP)"))
    finally:
        engine.dispose()


def test_ping_reports_an_unreachable_database():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    service = RegistryService.from_url(f"postgresql://nobody@127.0.0.1:{port}/none?connect_timeout=2")
    assert service.ping() is False


def test_ping_on_a_live_database(registry_service):
    assert registry_service.ping() is True
