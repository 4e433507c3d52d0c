"""What host misses cost the streams that are already decoding: adapters read on the engine
thread (as before) against read by the background ``HostLoader`` (the async engine's default).

    .venv/bin/python benchmarks/bench_host_miss.py [--model smollm2] [--rounds 2]

SmolLM2-135M-Instruct (the default real model), ``--num-adapters`` rank-8/16 adapters on all
seven projections (``bench_lora.make_adapters``), a host budget that holds two of them and two
device slots, so nearly every adapter request is a host miss. ``--base-streams`` base-model
streams decode ``--base-tokens`` tokens each while one adapter request (cycling through the
adapters, 4 tokens) arrives every ``--interval`` seconds. Printed per mode, medians over the
alternating rounds: the base streams' inter-token gaps (median, p99, max), the adapter
requests' time to first token, and how many host reads happened and what one took. Then the
same read for an adapter of Llama-3-8B's shapes (rank 16, all seven projections, 32 layers,
written to a temporary directory): how long every running stream paused per host miss when the
engine thread read it.

On a CPU-only machine the model's forward and a background read share the same cores, so the
first table shows parity more than gain; the gain is on an accelerator, where the engine thread
mostly waits for kernels and the read runs on otherwise idle cores.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--home", default="~/.loraplex")
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--base-streams", type=int, default=8)
    p.add_argument("--base-tokens", type=int, default=160)
    p.add_argument("--interval", type=float, default=0.15)
    p.add_argument("--rounds", type=int, default=2)
    return p.parse_args()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _workload(aengine, args, prompt: list[int], names: list[str]) -> tuple[list[float], list[float]]:
    from loraplex import SamplingParams

    gaps: list[float] = []
    ttfts: list[float] = []

    async def base_stream() -> None:
        last = None
        params = SamplingParams(temperature=0.0, max_tokens=args.base_tokens, ignore_eos=True)
        async for _ in aengine.generate(prompt, params):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now

    async def adapter_request(name: str) -> None:
        start, first = time.perf_counter(), True
        async for _ in aengine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                                        adapter=name):
            if first:
                ttfts.append(time.perf_counter() - start)
                first = False

    bases = [asyncio.create_task(base_stream()) for _ in range(args.base_streams)]
    await asyncio.sleep(0.3)  # the base streams are decoding
    extra, i = [], 0
    while not all(t.done() for t in bases):
        extra.append(asyncio.create_task(adapter_request(names[i % len(names)])))
        i += 1
        await asyncio.sleep(args.interval)
    await asyncio.gather(*bases, *extra)
    return gaps, ttfts


def main() -> int:
    args = _args()
    from bench_lora import make_adapters

    from loraplex import LLM, SamplingParams
    from loraplex.engine.async_engine import AsyncLLMEngine
    from loraplex.model.loader import load_tokenizer, resolve_model_dir

    home = Path(args.home).expanduser()
    model_dir, _ = resolve_model_dir(args.model, home)
    root = home / "bench_adapters" / f"{model_dir.name}-{args.num_adapters}"
    _, names = make_adapters(model_dir, root, args.num_adapters)
    tok = load_tokenizer(model_dir)
    prompt = list(tok("Write a long story about a lighthouse keeper.")["input_ids"])

    probe = LLM(model=args.model, dtype="bfloat16", home=home, max_loras=2, max_lora_rank=16)
    probe.add_adapter(names[1], str(root / names[1]))  # a rank-16 one
    adapter_bytes = max(w.nbytes for w in probe.engine.lora_manager.host._entries.values())
    del probe
    results: dict[str, list[tuple[list[float], list[float], int]]] = {"engine thread": [], "background": []}
    for _ in range(args.rounds):
        for mode in results:
            llm = LLM(model=args.model, dtype="bfloat16", home=home, max_loras=2, max_lora_rank=16,
                      max_cpu_lora_bytes=2 * adapter_bytes, max_num_seqs=64)
            for n in names:
                llm.add_adapter(n, str(root / n))
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))
            aengine = AsyncLLMEngine(llm.config, engine=llm.engine)
            if mode == "engine thread":
                llm.engine.lora_manager.stop_background_reads()
            try:
                gaps, ttfts = asyncio.run(_workload(aengine, args, prompt, names))
            finally:
                aengine.shutdown()
            per_adapter = llm.engine.stats()["lora"]["adapters"].values()
            reads = sum(a["host_loads"] for a in per_adapter) - len(names)
            results[mode].append((gaps, ttfts, reads))
            del llm, aengine

    print(f"# host misses: {args.base_streams} base streams x {args.base_tokens} tokens, an adapter request "
          f"every {args.interval:.2f} s over {len(names)} adapters ({adapter_bytes / 1e6:.1f} MB each in host "
          f"memory, room for 2); medians of {args.rounds} rounds")
    print("| adapters read on | base gap median ms | base gap p99 ms | base gap max ms | adapter TTFT median ms | host reads |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode, runs in results.items():
        med = statistics.median
        print(f"| {mode} | {med(1e3 * med(g) for g, _, _ in runs):.1f} | {med(1e3 * _pct(g, 0.99) for g, _, _ in runs):.1f} "
              f"| {med(1e3 * max(g) for g, _, _ in runs):.1f} | {med(1e3 * med(t) for _, t, _ in runs):.0f} "
              f"| {med(r for _, _, r in runs):.0f} |")
    read_s = _llama8b_read_seconds(args.rounds + 1)
    print(f"\none read of a Llama-3-8B-shaped rank-16 adapter (files, validation, content hash, host "
          f"weights; page cache warm): median {1e3 * statistics.median(read_s):.0f} ms of {len(read_s)}")
    return 0


def _llama8b_read_seconds(repeats: int) -> list[float]:
    """Seconds ``AdapterCatalog.parse`` takes for a rank-16 adapter on every projection of a
    Llama-3-8B (84 MB in bfloat16), read from a temporary directory."""
    import json
    import tempfile

    import torch
    from safetensors.torch import save_file

    from loraplex.config import EngineConfig
    from loraplex.lora.manager import LoRAManager
    from loraplex.lora.spec import LoRATargetSpec

    shapes = {"q_proj": (4096, 4096), "k_proj": (4096, 1024), "v_proj": (4096, 1024), "o_proj": (4096, 4096),
              "gate_proj": (4096, 14336), "up_proj": (4096, 14336), "down_proj": (14336, 4096)}
    layers, rank = 32, 16
    spec = LoRATargetSpec("llama-3-8b-shapes", layers, shapes)
    manager = LoRAManager(spec, EngineConfig(max_loras=1, max_lora_rank=rank), "cpu", torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        tensors = {}
        for i in range(layers):
            for module, (fan_in, fan_out) in shapes.items():
                prefix = f"base_model.model.model.layers.{i}.{'mlp' if module in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{module}"
                tensors[prefix + ".lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) * 0.01).to(torch.bfloat16)
                tensors[prefix + ".lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.01).to(torch.bfloat16)
        save_file(tensors, f"{tmp}/adapter_model.safetensors")
        with open(f"{tmp}/adapter_config.json", "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 32, "target_modules": list(shapes),
                       "task_type": "CAUSAL_LM"}, f)
        out = []
        for _ in range(repeats):
            started = time.perf_counter()
            manager.catalog.parse(tmp)
            out.append(time.perf_counter() - started)
    return out


if __name__ == "__main__":
    sys.exit(main())
