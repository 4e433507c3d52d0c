"""Host time of a decode step: what the engine spends around the model forward, per step.

    .venv/bin/python benchmarks/bench_host.py [--batch 64 256] [--context 32 1000] [--adapters 0 32]

On a GPU the forward of a decode step takes milliseconds, so the Python around it (scheduling,
batch preparation, sampling, detokenization, output delivery to the asyncio streams) decides
how busy the GPU is. This measures that part on any machine: a tiny random Llama (one layer,
hidden 32) makes the forward nearly free, ``batch`` streams run through ``AsyncLLMEngine`` as
the server drives it (one asyncio consumer per request), and each decode step's wall time is
split into the model forward (timed around ``runner.model``) and the rest (host: from one
step's start to the next, so delivering the outputs to the streams counts). Prints the median
per step over the decode steps of each configuration. No target: a figure to track.

``--cpu-time``: the engine alone (``LLMEngine.step``, no asyncio delivery), measured as the
engine thread's CPU time per decode step minus the forward's, 10th percentile and median over
150 steps: on a shared VM whose speed drifts, wall-clock medians of two versions can differ by
2x between runs, while the low percentiles of thread CPU time repeat within a few percent.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install


CPU_TIME_STEPS = 150  # decode steps measured per configuration with --cpu-time


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256], help="concurrent streams")
    p.add_argument("--context", type=int, nargs="+", default=[32, 1000], help="prompt tokens per stream")
    p.add_argument("--adapters", type=int, nargs="+", default=[0, 32], help="distinct adapters (round-robin)")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens generated per stream")
    p.add_argument("--cpu-time", action="store_true", help="engine only, thread CPU time (see module doc)")
    return p.parse_args()


class _TimedModel:
    """Wraps the runner's model: records the wall time of each forward."""

    def __init__(self, model, times: list[float]):
        self._model, self._times = model, times

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        out = self._model(*args, **kwargs)
        self._times.append(time.perf_counter() - start)
        return out

    def __getattr__(self, name):
        return getattr(self._model, name)


def _run(aengine, prompts: list[list[int]], adapters: list[str | None], max_tokens: int) -> None:
    from loraplex import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def consume(i: int) -> None:
        async for _ in aengine.generate(prompts[i], params, adapter=adapters[i]):
            pass

    async def main() -> None:
        await asyncio.gather(*(consume(i) for i in range(len(prompts))))

    asyncio.run(main())


def _cpu_time_rows(engine, prompts: list[list[int]], adapters: list[str | None], forward_cpu: list[float]) -> str:
    """One row of the ``--cpu-time`` table: host CPU per decode step, p10 and median."""
    from loraplex import SamplingParams

    steps = CPU_TIME_STEPS
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(None, prompt, params, adapter=adapters[i], stream_deltas=True)
    while engine.has_unfinished() and not all(len(s.output_token_ids) for s in engine.scheduler.running):
        engine.step()  # prefill until every stream decodes
    engine.step()
    host = []
    for _ in range(steps):
        n = len(forward_cpu)
        start = time.thread_time()
        engine.step()
        host.append(time.thread_time() - start - sum(forward_cpu[n:]))
    while engine.has_unfinished():
        engine.step()
    host.sort()
    batch = len(prompts)
    p10, p50 = host[len(host) // 10], host[len(host) // 2]
    return f"{p10 * 1e3:.2f} | {p50 * 1e3:.2f} | {p10 / batch * 1e6:.1f} |"


def main() -> int:
    args = _parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from loraplex.config import EngineConfig
    from loraplex.engine.async_engine import AsyncLLMEngine
    from tests.fixtures.peft_adapters import make_peft_adapter
    from tests.fixtures.tiny_models import make_tiny_model_dir

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="loraplex-bench-host-"))
    max_context = max(args.context)
    if args.cpu_time:
        args.max_tokens = CPU_TIME_STEPS + 8
    model_dir = make_tiny_model_dir(
        root / "model", "llama", num_hidden_layers=1, hidden_size=32, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_context + args.max_tokens + 16,
    )
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    max_adapters = max(args.adapters)
    adapter_dirs = [str(make_peft_adapter(base, root / f"a{i}", seed=i, r=8)) for i in range(max_adapters)]
    config = EngineConfig(
        model=str(model_dir), dtype="float32", device="cpu", home=root / "home", max_num_seqs=max(args.batch),
        # every prompt in one step, so that all streams then decode together
        max_num_batched_tokens=max(args.batch) * max_context, max_model_len=max_context + args.max_tokens + 16,
        kv_cache_bytes=1 << 30, max_loras=max(1, max_adapters), max_lora_rank=8, enable_prefix_caching=False,
    )
    if args.cpu_time:
        from loraplex.engine.llm_engine import LLMEngine

        engine = LLMEngine(config)
        model, forward_cpu = engine.runner.model, []
        forward = model.forward

        def timed_forward(*a, **k):
            start = time.thread_time()
            out = forward(*a, **k)
            forward_cpu.append(time.thread_time() - start)
            return out

        model.forward = timed_forward
        print(f"# torch {torch.__version__}, 1 thread; tiny Llama; engine thread CPU time per decode step minus the forward's")
        print("| streams | context | adapters | host ms p10 | host ms median | host us per stream (p10) |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for batch in args.batch:
            for context in args.context:
                for n_adapters in args.adapters:
                    prompts = [[4 + (i * 7 + j) % 250 for j in range(context)] for i in range(batch)]
                    adapters = [adapter_dirs[i % n_adapters] if n_adapters else None for i in range(batch)]
                    row = _cpu_time_rows(engine, prompts, adapters, forward_cpu)
                    print(f"| {batch} | {context} | {n_adapters} | {row}", flush=True)
        return 0
    aengine = AsyncLLMEngine(config)
    runner, engine = aengine.engine.runner, aengine.engine
    forward_times: list[float] = []
    runner.model = _TimedModel(runner.model, forward_times)
    step_times: list[tuple[float, int]] = []  # (start, outputs) of each step
    real_step = engine.step

    def timed_step(*args, **kwargs):  # AsyncLLMEngine passes step() its deliver callback
        start = time.perf_counter()
        out = real_step(*args, **kwargs)
        step_times.append((start, len(out)))
        return out

    engine.step = timed_step
    print(f"# torch {torch.__version__}, 1 thread; tiny Llama (1 layer, hidden 32); {args.max_tokens} tokens per stream")
    print("| streams | context | adapters | step ms | forward ms | host ms | host us per stream |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    try:
        for batch in args.batch:
            for context in args.context:
                for n_adapters in args.adapters:
                    prompts = [[4 + (i * 7 + j) % 250 for j in range(context)] for i in range(batch)]
                    adapters = [adapter_dirs[i % n_adapters] if n_adapters else None for i in range(batch)]
                    _run(aengine, prompts, adapters, 2)  # warm-up: adapters into slots, first calls
                    forward_times.clear()
                    step_times.clear()
                    _run(aengine, prompts, adapters, args.max_tokens)
                    # decode steps (every stream got a token) followed by another one: a step's
                    # time runs from its start to the next step's start, so the delivery of its
                    # outputs to the streams counts too
                    decode = [i for i, (_, n) in enumerate(step_times[:-1]) if n == batch][1:]
                    offset = len(forward_times) - len(step_times)
                    walls = [step_times[i + 1][0] - step_times[i][0] for i in decode]
                    forwards = [forward_times[i + offset] for i in decode]
                    hosts = [w - f for w, f in zip(walls, forwards)]
                    host = statistics.median(hosts)
                    print(f"| {batch} | {context} | {n_adapters} | {statistics.median(walls) * 1e3:.2f} | "
                          f"{statistics.median(forwards) * 1e3:.2f} | {host * 1e3:.2f} | {host / batch * 1e6:.1f} |",
                          flush=True)
    finally:
        aengine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
