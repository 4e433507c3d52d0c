"""Start ``loraplex serve`` as a real process on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.fixtures.ports import free_port

ADMIN_KEY = "e2e-admin-key"
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    log_path: Path
    verify: ssl.SSLContext | bool = True  # how clients check the certificate of a TLS server

    def admin(self, timeout: float = 30) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=timeout,
                            verify=self.verify)

    def client(self, key: str, timeout: float = 60) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout,
                            verify=self.verify)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_server(home: Path, model_dir: Path, *extra: str, ready_timeout: float = 240,
                 verify: ssl.SSLContext | bool = True) -> ServerProcess:
    """``extra`` flags go last; with ``--ssl-certfile`` among them the server speaks HTTPS, and
    ``verify`` (an SSL context trusting its CA) is how the readiness poll and clients check it."""
    port = free_port()
    env = {
        **os.environ,
        "LORAPLEX_HOME": str(home),
        "LORAPLEX_ADMIN_KEY": ADMIN_KEY,
        "PYTHONPATH": str(REPO_ROOT),
        "OMP_NUM_THREADS": "1",
    }
    for name in list(env):  # the test's own LORAPLEX_ settings must not leak in
        if name.startswith("LORAPLEX_") and name not in ("LORAPLEX_HOME", "LORAPLEX_ADMIN_KEY"):
            env.pop(name)
    cmd = [
        sys.executable, "-m", "loraplex.cli", "serve",
        "--model", str(model_dir), "--served-model-name", "base-model",
        "--host", "127.0.0.1", "--port", str(port),
        "--device", "cpu", "--dtype", "float32", "--log-level", "warning", *extra,
    ]
    log_path = home / "server.log"
    home.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:  # a file, not a pipe: a full pipe would stall the server
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
    url = f"{'https' if '--ssl-certfile' in extra else 'http'}://127.0.0.1:{port}"
    wait_ready(proc, url, log_path, ready_timeout, verify)
    return ServerProcess(proc, url, log_path, verify)


def wait_ready(proc: subprocess.Popen, url: str, log_path: Path, timeout: float,
               verify: ssl.SSLContext | bool = True) -> None:
    """Until ``url``/ready answers 200; the log's tail in the error if the process exits or
    ``timeout`` seconds pass (then it is killed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text(errors='replace')[-4000:]}")
        try:
            if httpx.get(url + "/ready", timeout=2, verify=verify).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"server not ready in {timeout}s:\n{log_path.read_text(errors='replace')[-4000:]}")
