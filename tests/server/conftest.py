"""The HTTP layer over a fake engine: a real uvicorn server in a thread on a free loopback port,
a real RegistryService on a throwaway SQLite database."""

from __future__ import annotations

import io
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from loraplex.config import Settings
from loraplex.registry import db
from loraplex.registry.service import RegistryService
from loraplex.server import http_options
from loraplex.server.http_protocol import BoundedHttpToolsProtocol
from loraplex.server.lifecycle import DrainingServer
from loraplex.server.app import create_app
from tests.fixtures.ports import free_port
from tests.server.fakes import FakeAdapterManager, FakeEngine

ADMIN_KEY = "test-admin-key"


@dataclass
class RunningServer:
    url: str
    app: object
    engine: FakeEngine
    registry: RegistryService
    adapters: FakeAdapterManager
    server: uvicorn.Server
    thread: threading.Thread

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)

    def tenant_client(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=10)

    def upload(self, tenant: str, name: str, payload: bytes = b"w", config: bytes = b'{"r": 4}') -> dict:
        """Upload a version of ``tenant``'s adapter ``name`` (the fake adapter manager takes any
        bytes); returns the version (``sha256``, ``version``, ...)."""
        files = {
            "adapter_config.json": ("adapter_config.json", io.BytesIO(config), "application/json"),
            "adapter_model.safetensors": ("adapter_model.safetensors", io.BytesIO(payload), "application/octet-stream"),
        }
        with self.admin() as c:
            r = c.post(f"/admin/v1/tenants/{tenant}/adapters/{name}/versions", files=files)
        assert r.status_code in (200, 201), r.text
        return r.json()

    def make_tenant(self, name: str) -> str:
        self.registry.create_tenant(name)
        _, secret = self.registry.create_api_key(name)
        return secret

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=3)
        if self.thread.is_alive():  # a stream a test left open: do not wait for it
            self.server.force_exit = True
            self.thread.join(timeout=10)


def start_server(tmp_path, engine: FakeEngine | None = None, make_adapters=None, database_url: str | None = None,
                 *, draining: bool = False, **setting_overrides) -> RunningServer:
    """``make_adapters(registry, home)`` gives the adapter manager (default: the fake one);
    ``database_url`` a registry shared with other servers (default: a SQLite file of its own).
    With ``draining`` the server is ``loraplex serve``'s ``DrainingServer``: a first
    ``server.handle_exit(signal.SIGTERM, None)`` drains it."""
    home = tmp_path / "home"
    home.mkdir(parents=True, exist_ok=True)
    url = database_url or f"sqlite:///{home / 'registry.db'}"
    db.upgrade(url)
    registry = RegistryService.from_url(url)
    engine = engine or FakeEngine()
    adapters = (make_adapters or (lambda r, h: FakeAdapterManager(r, h / "adapters")))(registry, home)
    settings = Settings(home=home, admin_key=ADMIN_KEY, database_url=url, **setting_overrides)
    app = create_app(settings, engine=engine, registry=registry, adapters=adapters)
    port = free_port()
    # TLS, the root path and the HTTP protocol as `loraplex serve` passes them to uvicorn
    config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on", http=BoundedHttpToolsProtocol,
                            **http_options.uvicorn_options(settings, "warning"))
    if draining:
        server = DrainingServer(config, app.state.ctx.lifecycle, settings.shutdown_grace_seconds)
    else:
        server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"{http_options.scheme(settings)}://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    # uvicorn's own flag: up once the app's startup ran and the socket listens (a poll of /ready
    # would need a client certificate on a server that asks for one)
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not become ready")
        time.sleep(0.05)
    return RunningServer(base, app, engine, registry, adapters, server, thread)


@pytest.fixture
def fake_server(tmp_path):
    srv = start_server(tmp_path)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def module_server(tmp_path_factory):
    """One server shared by a module's tests (each test makes its own tenants)."""
    srv = start_server(tmp_path_factory.mktemp("srv"))
    yield srv
    srv.stop()


@pytest.fixture
def server_factory(tmp_path):
    started = []

    def make(engine=None, make_adapters=None, **overrides) -> RunningServer:
        srv = start_server(tmp_path / f"s{len(started)}", engine, make_adapters, **overrides)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()
