"""The client side of bench_serving.py: closed-loop streaming users against the chat endpoint,
and the percentile / summary math over their requests (TTFT, inter-token gaps, end to end)."""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field

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


def distribution(xs: list[float]) -> dict[str, float]:
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
        ttft=distribution([s.ttft for s in good if s.ttft is not None]),
        itl=distribution([g for s in good for g in s.itls]),
        e2e=distribution([s.e2e for s in good if s.e2e is not None]),
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


