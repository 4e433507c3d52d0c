"""End-to-end part of the GPU check, continued: what host misses cost the streams already decoding.

A host miss is a request for an adapter that has left host memory: its files are read again
(validation, content hash, host weights). Read on the engine thread, every running stream waits
for the read; the async engine reads on worker threads (``loraplex/lora/host_loader.py``) while the
GPU keeps decoding. This runs both on the same model and adapters: base-model streams decode while
a request for another adapter (two fit in host memory, two in device slots) arrives every
``interval`` seconds, so nearly every one is a host miss; it reports the base streams' gaps
between tokens (median, p99, max) and how many reads there were, for each mode.
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import time
from pathlib import Path

import torch
from lab_common import Report

MODES = ("engine thread", "background")


def run_host_miss(report: Report, on_gpu: bool, model_dir: Path, adapter_dirs: list[Path], prompt_len: int,
                  root: Path, deadline: float) -> None:
    streams, tokens, interval = (32, 256, 0.05) if on_gpu else (4, 80, 0.02)
    report.line(f"## Host misses ({streams} base streams x {tokens} tokens; a request for one of "
                f"{len(adapter_dirs)} adapters every {interval * 1e3:.0f} ms, room for 2 in host memory and 2 slots)")
    report.line()
    rows = []
    for mode in MODES:
        if time.time() > deadline:
            report.line(f"time budget spent: host misses ({mode}) not run")
            break
        gaps, reads, read_ms = _run_mode(mode, on_gpu, model_dir, adapter_dirs, prompt_len, root, streams, tokens,
                                         interval)
        ordered = sorted(gaps)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        rows.append([mode, f"{statistics.median(gaps) * 1e3:.2f}", f"{p99 * 1e3:.2f}", f"{max(gaps) * 1e3:.2f}",
                     reads, f"{read_ms:.1f}"])
        print(f"  host misses, reads on the {mode}: max gap {max(gaps) * 1e3:.1f} ms over {reads} reads", flush=True)
    report.table(["adapters read on", "base gap median ms", "base gap p99 ms", "base gap max ms", "host reads",
                  "ms per read"], rows)
    report.line()


def _run_mode(mode: str, on_gpu: bool, model_dir: Path, adapter_dirs: list[Path], prompt_len: int, root: Path,
              streams: int, tokens: int, interval: float) -> tuple[list[float], int, float]:
    from loraplex import LLM
    from loraplex.engine.async_engine import AsyncLLMEngine

    from loraplex.lora.peft_format import inspect_adapter_dir
    from loraplex.lora.records import host_nbytes
    from loraplex.model.config import ModelSpec

    dtype = torch.bfloat16 if on_gpu else torch.float32
    spec = ModelSpec.from_dir(model_dir).lora_target_spec()
    adapter_bytes = max(host_nbytes(inspect_adapter_dir(d, spec, 16), spec, dtype) for d in adapter_dirs)
    probe = LLM(model=str(model_dir), dtype=str(dtype).removeprefix("torch."), device="cuda" if on_gpu else "cpu",
                home=root / f"home-miss-{mode.replace(' ', '-')}", max_loras=2, max_lora_rank=16,
                max_cpu_lora_bytes=2 * adapter_bytes,  # room for two: the others are read at each use
                max_num_seqs=streams + 16, max_model_len=prompt_len + tokens + 16, enable_prefix_caching=False)
    manager = probe.engine.lora_manager
    names = [f"m{i}" for i in range(len(adapter_dirs))]
    for name, path in zip(names, adapter_dirs):
        probe.add_adapter(name, str(path))
    aengine = AsyncLLMEngine(probe.config, engine=probe.engine)
    if mode == "engine thread":
        manager.stop_background_reads()
    gen = torch.Generator().manual_seed(7)
    vocab = probe.engine.vocab_size
    prompts = torch.randint(4, vocab, (streams, prompt_len), generator=gen).tolist()
    stats_before = probe.engine.stats()["lora"]["adapters"]
    try:
        gaps = asyncio.run(_workload(aengine, prompts, names, tokens, interval))
    finally:
        aengine.shutdown()
    after = probe.engine.stats()["lora"]["adapters"]
    reads = sum(a["host_loads"] - stats_before.get(k, {}).get("host_loads", 0) for k, a in after.items())
    seconds = sum(a["load_seconds"] - stats_before.get(k, {}).get("load_seconds", 0.0) for k, a in after.items())
    del aengine, probe, manager
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
    return gaps, reads, (seconds / reads * 1e3) if reads else 0.0


async def _workload(aengine, prompts: list[list[int]], names: list[str], tokens: int, interval: float) -> list[float]:
    from loraplex import SamplingParams

    gaps: list[float] = []

    async def base(prompt: list[int]) -> None:
        last = None
        async for _ in aengine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now

    async def adapter_request(prompt: list[int], name: str) -> None:
        async for _ in aengine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                                        adapter=name):
            pass

    bases = [asyncio.create_task(base(p)) for p in prompts]
    await asyncio.sleep(interval)
    extra, i = [], 0
    while not all(t.done() for t in bases):
        extra.append(asyncio.create_task(adapter_request(prompts[i % len(prompts)], names[i % len(names)])))
        i += 1
        await asyncio.sleep(interval)
    await asyncio.gather(*bases, *extra)
    return gaps
