"""The server's periodic blob garbage collection (``blob_gc_interval_seconds``)."""

from __future__ import annotations

import io
import logging
import os
import time

import pytest
from starlette.testclient import TestClient

from loraplex.config import Settings
from loraplex.lora.spec import LoRATargetSpec
from loraplex.registry import db
from loraplex.registry.adapter_manager import AdapterManager
from loraplex.registry.service import RegistryService
from loraplex.server.app import create_app
from loraplex.server.blob_gc import BlobGarbageCollector
from loraplex.storage.base import content_key, open_blob_store
from tests.registry.helpers import version_fields
from tests.server.fakes import FakeEngine

HOUR = 3600.0
WAIT_S = 10.0


@pytest.fixture
def setup(tmp_path):
    """A real AdapterManager over SQLite and a local store holding three blobs, the first two
    two hours old: an orphan, one a live version uses, and an orphan stored a moment ago."""
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    db.upgrade(url)
    registry = RegistryService.from_url(url)
    registry.create_tenant("acme")
    blobs = open_blob_store(str(tmp_path / "blobs"))
    spec = LoRATargetSpec(model_name="unused", num_layers=0, module_shapes={})
    manager = AdapterManager(registry, blobs, AdapterManager.make_disk_cache(tmp_path / "cache", 1 << 20), spec, 16)
    keys = {}
    for name, content in (("orphan", b"left by a crash"), ("used", b"a live version"), ("young", b"upload in progress")):
        fields = version_fields(content)
        keys[name] = fields["blob_key"]
        blobs.put(keys[name], io.BytesIO(content), len(content))
        if name == "used":
            registry.add_version("acme", "kept", **fields)
        if name != "young":
            old = time.time() - 2 * HOUR
            os.utime(blobs.root.joinpath(*keys[name].split("/")), (old, old))
    return manager, blobs, keys


def _wait_until(condition, timeout: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_collector_removes_old_orphans_only_and_stops(setup):
    manager, blobs, keys = setup
    collector = BlobGarbageCollector(manager.collect_garbage, interval_seconds=0.1, min_age_seconds=HOUR)
    assert collector.initial_delay_seconds == 0.1  # min(60 s, interval)
    with collector:
        assert _wait_until(lambda: not blobs.exists(keys["orphan"]))
        assert _wait_until(lambda: collector.runs >= 2)  # and it keeps running
        assert collector.running
    assert not collector.running
    assert collector.deleted_total == 1 and collector.errors == 0
    assert blobs.exists(keys["used"]) and blobs.exists(keys["young"])


def test_collector_logs_errors_and_keeps_running(caplog):
    calls = []

    def failing_collect(min_age_seconds, stop):
        calls.append(min_age_seconds)
        raise RuntimeError("store unreachable")

    with caplog.at_level(logging.ERROR, logger="loraplex.server"):
        with BlobGarbageCollector(failing_collect, interval_seconds=0.05, min_age_seconds=5.0) as collector:
            assert _wait_until(lambda: collector.errors >= 2)
            assert collector.running
    assert calls[0] == 5.0 and not collector.running
    assert "blob garbage collection failed" in caplog.text and "store unreachable" in caplog.text


def test_collector_rejects_a_zero_interval():
    with pytest.raises(ValueError):
        BlobGarbageCollector(lambda **_: [], interval_seconds=0, min_age_seconds=HOUR)


def test_server_runs_the_collector_until_shutdown(setup, tmp_path):
    manager, blobs, keys = setup
    settings = Settings(home=tmp_path / "home", admin_key="k", blob_gc_interval_seconds=0.1)
    app = create_app(settings, engine=FakeEngine(), registry=manager.registry, adapters=manager)
    with TestClient(app) as client:
        assert client.get("/ready").status_code == 200
        collector = app.state.blob_gc
        assert collector is not None and collector.min_age_seconds == HOUR  # the default
        assert _wait_until(lambda: not blobs.exists(keys["orphan"]))
    assert not collector.running  # stopped at shutdown
    assert blobs.exists(keys["used"]) and blobs.exists(keys["young"])


def test_server_collector_disabled_by_zero_interval(setup, tmp_path):
    manager, blobs, keys = setup
    settings = Settings(home=tmp_path / "home", admin_key="k", blob_gc_interval_seconds=0)
    app = create_app(settings, engine=FakeEngine(), registry=manager.registry, adapters=manager)
    with TestClient(app):
        assert app.state.blob_gc is None
    assert blobs.exists(keys["orphan"])
