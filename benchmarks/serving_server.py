"""The server side of bench_serving.py: ``loraplex serve`` as a subprocess on a free loopback port,
tenant and adapter setup over the admin API, idle-state and metrics reads, the server's access
log, and the CPU meter that tells whether a run had the machine to itself."""

from __future__ import annotations

import json
import math
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from serving_client import TENANT

from tests.e2e.server_process import REPO_ROOT, wait_ready
from tests.fixtures.ports import free_port


# --- the server -------------------------------------------------------------------------------


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: Path
    admin_key: str

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                print(f"! server did not exit {timeout:.0f}s after SIGTERM: killed", flush=True)
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


def start_server(home: Path, model_dir: Path, served_name: str, extra: list[str], ready_timeout: float = 300) -> Server:
    port = free_port()
    admin_key = "bench-admin-" + secrets.token_hex(8)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}  # only what we set
    env.update(LORAPLEX_HOME=str(home), LORAPLEX_ADMIN_KEY=admin_key,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "loraplex.cli", "serve", "--model", str(model_dir),
           "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port), *extra]
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / "server.log"
    print("# server:", " ".join(shlex.quote(c) for c in cmd[1:]), flush=True)
    with open(log_path, "ab") as log:  # a file, not a pipe: a full pipe would stall the server
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url, log_path, ready_timeout)
    return Server(proc, url, log_path, admin_key)


def setup_tenant(url: str, admin_key: str, adapter_dirs: list[Path], tenant: str = TENANT) -> tuple[str, list[str], str]:
    """Create ``tenant`` (reused if it exists), a fresh key, and one adapter per directory
    (``a0``, ``a1``, ...) over the admin API. Returns (key, adapter names, base model name)."""
    import httpx

    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=120) as admin:
        r = admin.post("/admin/v1/tenants", json={"name": tenant})
        if r.status_code not in (201, 409):
            raise RuntimeError(f"create tenant: {r.status_code} {r.text}")
        r = admin.post(f"/admin/v1/tenants/{tenant}/keys")
        if r.status_code != 201:
            raise RuntimeError(f"create key: {r.status_code} {r.text}")
        key = r.json()["key"]
        names = []
        for i, d in enumerate(adapter_dirs):
            name = f"a{i}"
            files = {f: (f, (d / f).read_bytes(), "application/octet-stream")
                     for f in ("adapter_config.json", "adapter_model.safetensors")}
            r = admin.post(f"/admin/v1/tenants/{tenant}/adapters/{name}/versions", files=files)
            if r.status_code not in (200, 201):
                raise RuntimeError(f"upload {name}: {r.status_code} {r.text}")
            names.append(name)
    models = httpx.get(f"{url}/t/{tenant}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
    base = next(m["id"] for m in models["data"] if m.get("parent") is None)
    return key, names, base


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {series without labels: value}, summed over label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            pass
    return out


def idle_state(url: str, admin_key: str, timeout: float = 30.0) -> dict:
    """Wait until nothing runs or waits, then: KV usage from /metrics, engine counters from
    /admin/v1/status, and how long it took to get idle."""
    import httpx

    start = time.monotonic()
    while True:
        m = parse_metrics(httpx.get(url + "/metrics", timeout=30).text)
        busy = m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0)
        if busy == 0 or time.monotonic() - start > timeout:
            break
        time.sleep(0.1)
    status = httpx.get(url + "/admin/v1/status", headers={"Authorization": f"Bearer {admin_key}"}, timeout=30).json()
    engine = status.get("engine") or {}
    return {
        "kv_cache_usage_perc": m.get("vllm:kv_cache_usage_perc", math.nan),
        "num_requests_running": m.get("vllm:num_requests_running", math.nan),
        "num_requests_waiting": m.get("vllm:num_requests_waiting", math.nan),
        "idle_after_s": time.monotonic() - start,
        "num_preemptions": engine.get("num_preemptions"),
        "num_starvation_preemptions": engine.get("num_starvation_preemptions"),
        "num_blocks_free": engine.get("num_blocks_free"),
        "num_blocks_total": engine.get("num_blocks_total"),
        "in_flight": status.get("in_flight"),
    }


def adapter_tiers(url: str, admin_key: str, tenant: str = TENANT) -> dict[str, int]:
    import httpx

    r = httpx.get(f"{url}/admin/v1/tenants/{tenant}/adapters", headers={"Authorization": f"Bearer {admin_key}"}, timeout=30)
    counts: dict[str, int] = {}
    for a in r.json().get("data", []):
        tier = a.get("tier") or next((v.get("tier") for v in a.get("versions", []) if v.get("tier")), None) or "?"
        counts[tier] = counts.get(tier, 0) + 1
    return counts


def _cpu_busy_s() -> float:
    """Busy CPU seconds of the whole machine so far (/proc/stat; steal included); NaN off Linux."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        return math.nan


def _proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) of one process so far; NaN if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return math.nan


class CpuMeter:
    """Cores used between start and stop by the server, by this client, and by everything else
    on the machine (other processes, VM steal): a busy neighbour explains bad figures on a
    2-core box."""

    def __init__(self, server_pid: int):
        self.server_pid = server_pid

    def __enter__(self) -> "CpuMeter":
        self._t = time.perf_counter()
        self._busy, self._srv, self._me = _cpu_busy_s(), _proc_cpu_s(self.server_pid), _proc_cpu_s(os.getpid())
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._t
        busy = _cpu_busy_s() - self._busy
        srv, me = _proc_cpu_s(self.server_pid) - self._srv, _proc_cpu_s(os.getpid()) - self._me
        self.server, self.client, self.other = srv / wall, me / wall, max(busy - srv - me, 0.0) / wall



def access_records(log_path: Path, offset: int) -> tuple[list[dict], int]:
    """The server's access-log records (one JSON line per request) written after ``offset``."""
    with open(log_path, "rb") as f:
        f.seek(offset)
        data = f.read()
    records = []
    for line in data.decode(errors="replace").splitlines():
        if line.startswith('{"event":"request"'):
            try:
                records.append(json.loads(line))
            except ValueError:
                pass
    return records, offset + len(data)


def server_problems(log: str) -> list[str]:
    """Log lines that point at trouble: tracebacks, errors, non-200 access lines."""
    lines = []
    for line in log.splitlines():
        if line.startswith('{"event":"request"'):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("status") != 200:
                lines.append(line)
        elif "Traceback" in line or " ERROR " in line or " CRITICAL " in line:
            lines.append(line)
    return lines


