"""Decode step time with overlap_outputs off and on, against a stand-in device, on any machine.

    .venv/bin/python benchmarks/bench_overlap.py [--batch 256] [--adapters 64] [--device-ms 0 1.3 3]

``overlap_outputs`` makes a step's outputs (detokenizing, stop strings, output objects) while
the device runs the next step. On CPU the forward is synchronous, so nothing can overlap: this
runs the engine's CUDA-graph decode path (as ``bench_graph_host.py`` does: a tiny Llama, a
replay that launches nothing) with a stand-in device whose work takes ``--device-ms`` from the
replay on. Reading a step's tokens back waits until then, as ``.tolist()`` waits for a GPU. The
host work is the engine's own; only the device is imagined. H200 call 5 measured 1.3 ms of graph
device time per step at batch 256 on a 4-layer model (kernels/RESULTS.md); the 32-layer model
would take about 8 times that. Prints the median step per setting, off and on, side by side (runs
alternate), and checks that both give the same tokens.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_graph_host's graph stand-in


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256, help="streams decoding together")
    p.add_argument("--adapters", type=int, default=64, help="distinct adapters (round-robin; 0: base model)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per stream")
    p.add_argument("--device-ms", type=float, nargs="+", default=[0.0, 1.3, 3.0],
                   help="the stand-in device's time per decode step")
    p.add_argument("--rounds", type=int, default=7, help="runs of each setting (alternating off and on)")
    return p.parse_args()


class StandInDevice:
    """Device time per step: starts when the graph replays; reading the tokens back waits for it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.ready_at = 0.0

    def run(self) -> None:
        self.ready_at = time.perf_counter() + self.seconds

    def wait(self) -> None:
        # spins, as a CUDA synchronisation does by default (a sleep would add its wake-up)
        ready_at = self.ready_at
        while time.perf_counter() < ready_at:
            pass


def main() -> int:
    args = _parse_args()
    import torch

    from bench_graph_host import PROMPT_LEN, tiny_graph_llm
    from loraplex import SamplingParams
    from loraplex.engine import model_runner

    llm, names, vocab_size = tiny_graph_llm("loraplex-bench-overlap-", args.batch, args.adapters, args.max_tokens)
    engine, graphs = llm.engine, llm.engine.runner.decode_graphs
    device = StandInDevice()

    # the stand-in: a replay starts the device's work, a read-back of the tokens waits for it
    run_graph, result = graphs.run, model_runner.PendingRun.result

    def run_and_start(*a, **kw):
        out = run_graph(*a, **kw)
        device.run()
        return out

    def waited_result(self):
        device.wait()
        return result(self)

    graphs.run = run_and_start
    model_runner.PendingRun.result = waited_result

    step_starts: list[float] = []
    engine_step = engine.step

    def timed_step(*a, **kw):
        step_starts.append(time.perf_counter())
        return engine_step(*a, **kw)

    engine.step = timed_step
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, vocab_size, (args.batch, PROMPT_LEN), generator=gen).tolist()
    adapters = [names[i % args.adapters] if args.adapters else None for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    gc.collect()
    gc.freeze()  # as `loraplex serve` does once its model is loaded

    def decode_steps_ms(overlap: bool) -> tuple[list[float], list[list[int]]]:
        engine.overlap_outputs = overlap
        step_starts.clear()
        outs = llm.generate(prompts, params, adapters=adapters)
        step_starts.append(time.perf_counter())
        # from one step's start to the next one's: the whole loop, outputs included; the first
        # steps (prefill, the first decode) and the flush are left out
        gaps = [(b - a) * 1e3 for a, b in zip(step_starts, step_starts[1:])][2:-2]
        return gaps, [o.outputs[0].token_ids for o in outs]

    try:
        llm.generate(prompts, params, adapters=adapters)  # warm: slots filled, graphs "captured"
        rows = []
        for seconds in args.device_ms:
            device.seconds = seconds / 1e3
            # per run its median step; per setting the median of those: on this VM a run now and
            # then comes out 1.5x slower whatever it runs, which pooled steps would carry along
            medians: dict[bool, list[float]] = {False: [], True: []}
            tokens: dict[bool, list[list[int]]] = {}
            for _ in range(args.rounds):
                for overlap in (False, True):
                    steps, tokens[overlap] = decode_steps_ms(overlap)
                    medians[overlap].append(statistics.median(steps))
            if tokens[False] != tokens[True]:
                raise SystemExit("overlap_outputs changed the generated tokens")
            rows.append((seconds, statistics.median(medians[False]), statistics.median(medians[True])))
    finally:
        model_runner.PendingRun.result = result
    print(f"Decode step ms (median of {args.rounds} runs' medians, {args.max_tokens} tokens each), batch {args.batch}, "
          f"{args.adapters} adapters, stand-in device; the same tokens with and without overlap:\n")
    print("| device ms per step | overlap_outputs off | on | on / off |")
    print("| ---: | ---: | ---: | ---: |")
    for seconds, off, on in rows:
        print(f"| {seconds:.1f} | {off:.3f} | {on:.3f} | {on / off:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
