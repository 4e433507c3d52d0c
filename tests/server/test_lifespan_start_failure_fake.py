"""A start that fails part-way stops what it had started, then raises its own error: for a
failure injected at each start step of the app's lifespan (fake engine, real registry on
SQLite, every background part on: blob collection, usage accounting, cluster heartbeats), no
background thread of the app is left alive, the replica's heartbeat row is gone from the
registry, the engine is shut down, and the error raised is the injected one. Driven once
directly through the lifespan (the error itself), once through uvicorn as ``loraplex serve``
runs it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from loraplex.config import Settings
from loraplex.registry import db
from loraplex.registry.service import RegistryService
from loraplex.server import app as app_module
from loraplex.server.app import create_app
from loraplex.server.components import Components
from tests.server.conftest import ADMIN_KEY, start_server
from tests.server.fakes import FakeAdapterManager, FakeEngine

# the app's background threads (blob_gc.py, usage_recorder.py, cluster_presence.py, context.py)
APP_THREADS = ("blob-gc", "usage-flush", "replica-heartbeat", "loraplex-tokenize")


class InjectedFailure(RuntimeError):
    pass


class CollectingAdapters(FakeAdapterManager):
    """The fake adapter manager with the blob collection the server runs in its thread."""

    def collect_garbage(self, min_age_seconds, stop):
        return []


def _app_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.is_alive() and t.name.startswith(APP_THREADS)}


def _wait_for_no_new_threads(before: set[threading.Thread]) -> set[str]:
    """The app threads started since ``before`` still alive after a short wait (a thread pool's
    worker ends a moment after its shutdown)."""
    deadline = time.monotonic() + 5
    while (left := _app_threads() - before) and time.monotonic() < deadline:
        time.sleep(0.02)
    return {t.name for t in left}


def _settings(home, url) -> Settings:
    return Settings(home=home, admin_key=ADMIN_KEY, database_url=url, tenant_limits_scope="cluster",
                    registry_poll_seconds=0.2, blob_gc_interval_seconds=60, usage_flush_seconds=5)


@pytest.fixture
def parts(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    url = f"sqlite:///{home / 'registry.db'}"
    db.upgrade(url)
    registry = RegistryService.from_url(url)
    return home, url, registry, FakeEngine(), CollectingAdapters(registry, home / "adapters")


def _fail(*args, **kwargs):
    raise InjectedFailure("injected")


# the start step that fails: how the failure (a callable that raises) is put in its place, and
# the app threads running when it is raised
STEPS = {
    "build": (None, set()),
    "use_parts": (lambda mp, fail: mp.setattr(app_module, "use_parts", fail), set()),
    "staging sweep": (lambda mp, fail: mp.setattr(app_module, "sweep_stale_staging", fail), set()),
    "blob gc": (lambda mp, fail: mp.setattr(app_module, "BlobGarbageCollector", fail), set()),
    "usage recorder": (lambda mp, fail: mp.setattr(app_module, "UsageRecorder", fail), {"blob-gc"}),
    "usage metrics": (lambda mp, fail: mp.setattr(app_module, "UsageCollector", fail), {"blob-gc", "usage-flush"}),
    "presence": (lambda mp, fail: mp.setattr(app_module, "_start_presence", fail), {"blob-gc", "usage-flush"}),
    "on_started": (None, {"blob-gc", "usage-flush", "replica-heartbeat", "loraplex-tokenize"}),
}


@pytest.mark.parametrize("step", list(STEPS))
def test_a_failed_start_step_stops_what_had_started(parts, monkeypatch, step):
    home, url, registry, engine, adapters = parts
    inject, running_at_failure = STEPS[step]
    seen_at_failure: dict = {}

    def failure(*args, **kwargs):
        """Records the app threads and heartbeat rows there are, then raises."""
        seen_at_failure["threads"] = {t.name.split("_")[0] for t in _app_threads() - before}
        seen_at_failure["rows"] = registry.replicas_seen(60)
        raise InjectedFailure("injected")

    def on_started():
        # the tokenizer thread too: it starts on its first job
        app.state.ctx.tokenizer_thread.submit(lambda: None).result()
        failure()

    kwargs = {"engine": engine, "registry": registry, "adapters": adapters}
    if step == "build":  # the engine is built at start, and that fails
        kwargs = {"registry": registry, "adapters": adapters, "builder": failure}
    elif step == "on_started":
        kwargs["on_started"] = on_started
    else:
        inject(monkeypatch, failure)
    app = create_app(_settings(home, url), **kwargs)
    before = _app_threads()

    async def start() -> None:
        async with app.router.lifespan_context(app):
            pytest.fail("the start should have failed")

    with pytest.raises(InjectedFailure, match="injected"):
        asyncio.run(start())
    # the failure came with the expected parts running
    assert seen_at_failure["threads"] == running_at_failure
    assert len(seen_at_failure["rows"]) == (1 if step == "on_started" else 0)
    assert _wait_for_no_new_threads(before) == set()
    assert registry.replicas_seen(60) == []  # the heartbeat row is gone, not left to expire
    assert engine.shut_down is (step != "build")  # a build that failed built no engine here
    assert app.state.ctx.lifecycle.started is False


def test_shutdown_stops_every_part_when_one_fails_and_raises_that_error(parts):
    home, url, registry, engine, adapters = parts
    engine.shutdown = _fail
    app = create_app(_settings(home, url), engine=engine, registry=registry, adapters=adapters)
    before = _app_threads()

    async def serve_then_stop() -> None:
        async with app.router.lifespan_context(app):
            assert {t.name for t in _app_threads() - before} == {"blob-gc", "usage-flush", "replica-heartbeat"}
            assert len(registry.replicas_seen(60)) == 1

    with pytest.raises(InjectedFailure):
        asyncio.run(serve_then_stop())
    assert _wait_for_no_new_threads(before) == set()
    assert registry.replicas_seen(60) == []
    assert app.state.ctx.usage.running is False


def test_a_failed_build_stops_the_engine_it_built(tmp_path, monkeypatch):
    """``build_components`` builds the engine (its thread starts there) then the adapter
    manager: a failure in the second stops the first, as the caller never gets it."""
    from loraplex.engine import async_engine
    from loraplex.registry import adapter_manager
    from loraplex.server.components import build_components

    built = []

    class Engine:
        def __init__(self, config):
            self.engine = self  # the attributes build_components reaches through
            self.runner = self
            self.shut_down = False
            built.append(self)

        def warm_grammars(self):
            pass

        def lora_target_spec(self):
            return None

        def shutdown(self):
            self.shut_down = True

    monkeypatch.setattr(async_engine, "AsyncLLMEngine", Engine)
    monkeypatch.setattr(adapter_manager, "build_adapter_manager", _fail)
    monkeypatch.setattr(Settings, "engine_config", lambda self: None)
    home = tmp_path / "home"
    settings = Settings(home=home, admin_key=ADMIN_KEY, database_url=f"sqlite:///{tmp_path / 'r.db'}")
    with pytest.raises(InjectedFailure):
        build_components(settings, registry=object())
    assert len(built) == 1 and built[0].shut_down
    # an engine the caller gave is the caller's to stop
    given = Engine(None)
    with pytest.raises(InjectedFailure):
        build_components(settings, engine=given, registry=object())
    assert given.shut_down is False
    assert isinstance(build_components(settings, engine=given, registry=object(), adapters="a"), Components)


def test_serve_with_a_failing_on_started_exits_leaving_nothing_behind(tmp_path, monkeypatch):
    """Through uvicorn, as ``loraplex serve`` runs the app: the server never starts, its thread
    (uvicorn's, here the process) ends, and what the lifespan started is stopped."""
    failed = threading.Event()

    def on_started():
        failed.set()
        raise InjectedFailure("injected")

    original = app_module.create_app
    monkeypatch.setattr("tests.server.conftest.create_app",
                        lambda settings, **kw: original(settings, on_started=on_started, **kw))
    exits = []  # uvicorn ends a failed start with sys.exit(3): in the process, its exit status
    monkeypatch.setattr(threading, "excepthook", lambda args: exits.append(args.exc_value))
    before = _app_threads()
    with pytest.raises(RuntimeError, match="did not become ready"):
        start_server(tmp_path, make_adapters=lambda r, h: CollectingAdapters(r, h / "adapters"),
                     tenant_limits_scope="cluster", registry_poll_seconds=0.2, blob_gc_interval_seconds=60)
    assert failed.is_set()
    assert [type(e) for e in exits] == [SystemExit] and exits[0].code == 3
    assert _wait_for_no_new_threads(before) == set()
    registry = RegistryService.from_url(f"sqlite:///{tmp_path / 'home' / 'registry.db'}")
    assert registry.replicas_seen(60) == []
