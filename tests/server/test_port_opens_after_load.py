"""What a probe sees while ``loraplex serve`` loads its model (README "Start", the k8s manifest).

The model is built inside the app's startup and uvicorn opens the port only after the startup
has finished, as vLLM's server opens its port after building its engine: during the load a probe
gets no connection at all (not a 503), then ``/health`` and ``/ready`` both answer 200. The k8s
manifest's startupProbe exists because of this.
"""

from __future__ import annotations

import threading
import time

import httpx
import uvicorn

from loraplex.config import Settings
from loraplex.server.app import create_app
from loraplex.server.components import Components, prepare_registry
from tests.fixtures.ports import free_port
from tests.server.fakes import FakeAdapterManager, FakeEngine


def test_no_connection_while_the_model_loads_then_health_and_ready(tmp_path):
    settings = Settings(home=tmp_path / "home", admin_key="k")
    setup = prepare_registry(settings, create_demo=False)
    building, release = threading.Event(), threading.Event()

    def slow_build(settings, engine=None, registry=None, adapters=None):
        building.set()
        assert release.wait(30)
        return Components(FakeEngine(), setup.registry, FakeAdapterManager(setup.registry, tmp_path))

    app = create_app(settings, registry=setup.registry, builder=slow_build)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        assert building.wait(30)
        time.sleep(0.3)  # time for uvicorn to have bound the port, had it done so before the startup
        for path in ("/health", "/ready"):
            try:
                answer = httpx.get(url + path, timeout=2)
            except httpx.ConnectError:
                continue
            raise AssertionError(f"{path} answered {answer.status_code} while the model was loading")
        release.set()
        for _ in range(200):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        assert httpx.get(url + "/health", timeout=2).status_code == 200
        assert httpx.get(url + "/ready", timeout=2).status_code == 200
    finally:
        release.set()
        server.should_exit = True
        thread.join(timeout=10)
