"""`loraplex serve` settings from flags, and the first-start registry setup (admin key, demo)."""

from __future__ import annotations

import threading
import time

import httpx
import uvicorn

from loraplex.cli import build_parser
from loraplex.config import Settings
from loraplex.server.app import create_app
from loraplex.server.cli import settings_from_args
from loraplex.server.components import prepare_registry
from tests.fixtures.ports import free_port
from tests.server.fakes import FakeAdapterManager, FakeEngine


def test_every_setting_is_a_flag_and_flags_win(monkeypatch, tmp_path):
    monkeypatch.setenv("LORAPLEX_MAX_LORAS", "3")
    monkeypatch.setenv("LORAPLEX_PORT", "9999")
    args = build_parser().parse_args([
        "serve", "--model", "m", "--port", "1234", "--home", str(tmp_path), "--no-enable-prefix-caching",
        "--max-model-len", "64", "--kv-cache-memory-fraction", "0.5",
    ])
    s = settings_from_args(args)
    assert (s.model, s.port, s.max_loras, s.home) == ("m", 1234, 3, tmp_path)  # env where no flag
    assert s.enable_prefix_caching is False and s.max_model_len == 64 and s.kv_cache_memory_fraction == 0.5
    engine = s.engine_config()
    assert engine.max_model_len == 64 and engine.enable_prefix_caching is False
    # no flag for the admin key (it would show in the process list)
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "--admin-key" not in help_text and "--max-lora-rank" in help_text


def test_first_start_generates_admin_key_and_demo_tenant(tmp_path):
    settings = Settings(home=tmp_path / "home")
    first = prepare_registry(settings, create_demo=True)
    assert first.admin_secret and first.demo_key
    assert first.registry.check_admin_key(first.admin_secret)
    assert first.registry.authenticate(first.demo_key) == "demo"
    again = prepare_registry(settings, create_demo=True)
    assert again.admin_secret is None and again.demo_key is None  # shown once only
    assert again.registry.check_admin_key(first.admin_secret)


def test_stored_admin_key_guards_admin_routes(tmp_path):
    settings = Settings(home=tmp_path / "home")  # no admin_key: the registry's hash decides
    setup = prepare_registry(settings, create_demo=False)
    app = create_app(settings, engine=FakeEngine(), registry=setup.registry,
                     adapters=FakeAdapterManager(setup.registry, tmp_path))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                if httpx.get(url + "/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        ok = httpx.get(url + "/admin/v1/tenants", headers={"Authorization": f"Bearer {setup.admin_secret}"})
        assert ok.status_code == 200
        bad = httpx.get(url + "/admin/v1/tenants", headers={"Authorization": "Bearer lpx_admin_wrong"})
        assert bad.status_code == 401
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_on_started_runs_once_after_the_parts_are_built(tmp_path):
    from starlette.testclient import TestClient

    settings = Settings(home=tmp_path / "home", admin_key="k")
    setup = prepare_registry(settings, create_demo=False)
    seen = []
    app = create_app(settings, engine=FakeEngine(), registry=setup.registry,
                     adapters=FakeAdapterManager(setup.registry, tmp_path),
                     on_started=lambda: seen.append(app.state.ctx.lifecycle.started))
    with TestClient(app) as client:
        assert client.get("/ready").status_code == 200
    assert seen == [False]  # once, before the server took requests


def test_serve_freezes_the_objects_alive_after_start_up():
    """``loraplex serve`` hands its start-up objects (model, torch, transformers) to the
    permanent generation: full collections stop scanning them (vLLM does the same)."""
    import subprocess
    import sys

    code = (
        # triton's nanobind bindings report objects still frozen at exit as leaks
        "import gc, torch, transformers, triton\n"
        "from loraplex.server.cli import freeze_startup_objects\n"
        "before = len(gc.get_objects())\n"
        "freeze_startup_objects()\n"
        "assert gc.get_freeze_count() >= before // 2 > 10000, (before, gc.get_freeze_count())\n"
        "assert len(gc.get_objects()) < 1000\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "leaked" not in proc.stderr, proc.stderr[-2000:]


def test_a_deleted_demo_tenant_is_not_recreated_at_the_next_start(tmp_path):
    settings = Settings(home=tmp_path / "home")
    first = prepare_registry(settings, create_demo=True)
    first.registry.delete_tenant("demo")
    again = prepare_registry(settings, create_demo=True)  # starts; no new demo tenant or key
    assert again.demo_key is None and again.registry.list_tenants() == []
    assert any("'demo' was deleted; not recreated" in note for note in again.notes)
    assert again.registry.authenticate(first.demo_key) is None
