"""The Kubernetes manifest's probes fit how the server starts.

``loraplex serve`` loads the model inside the app's startup and uvicorn opens the port only after
it (as vLLM's server does), so during a load every probe gets no connection. Kubernetes runs
liveness and readiness probes only once the startup probe has passed; without a startup probe the
liveness probe (3 failures by default) restarts a replica whose model takes longer than its window
to load, over and over.
"""

from __future__ import annotations

from pathlib import Path

import yaml

MANIFEST = Path(__file__).resolve().parents[1] / "deploy" / "k8s" / "loraplex.yaml"
# a large model's first load (weights read from a volume, KV cache allocated) fits in this
MIN_STARTUP_SECONDS = 600


def _container() -> dict:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_liveness_waits_for_a_startup_probe_long_enough_for_a_model_load():
    container = _container()
    assert "livenessProbe" in container
    startup = container.get("startupProbe")
    assert startup is not None, "no startupProbe: the liveness probe kills replicas whose model is still loading"
    assert startup["httpGet"]["path"] == "/health"
    # Kubernetes' defaults: periodSeconds 10, failureThreshold 3
    window = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
    assert window >= MIN_STARTUP_SECONDS


def test_readiness_is_the_ready_route():
    assert _container()["readinessProbe"]["httpGet"]["path"] == "/ready"
