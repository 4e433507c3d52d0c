"""Decode step time with overlap_outputs and schedule_ahead off and on, against a stand-in device, on any machine.

    .venv/bin/python benchmarks/bench_overlap.py [--batch 256] [--adapters 64] [--device-ms 0 1.3 3]

``overlap_outputs`` makes a step's outputs (detokenizing, stop strings, output objects) while
the device runs the next step; ``schedule_ahead`` also schedules, prepares and launches the next
plain decode step before this one's tokens are read back, so the device's steps queue back to
back. On CPU the forward is synchronous, so nothing can overlap: this
runs the engine's CUDA-graph decode path (as ``bench_graph_host.py`` does: a tiny Llama, a
replay that launches nothing) with a stand-in device whose work takes ``--device-ms`` from the
replay on. Reading a step's tokens back waits until then, as ``.tolist()`` waits for a GPU. The
host work is the engine's own; only the device is imagined. H200 call 5 measured 1.3 ms of graph
device time per step at batch 256 on a 4-layer model (kernels/RESULTS.md); the 32-layer model
would take about 8 times that. Prints the median step per setting side by side (runs alternate),
and checks that all give the same tokens.
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
    """Device time per step: a step's work starts when its graph replays or when the step queued
    before it ends, whichever is later (steps launched ahead queue up); reading a step's tokens
    back waits for its own end."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.free_at = 0.0

    def enqueue(self) -> float:
        self.free_at = max(time.perf_counter(), self.free_at) + self.seconds
        return self.free_at

    @staticmethod
    def wait(ready_at: float) -> None:
        # spins, as a CUDA synchronisation does by default (a sleep would add its wake-up)
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

    # the stand-in: a graph step queues the device's work, a read-back of its tokens waits for it
    runner = engine.runner
    execute_graph, result = runner._execute_graph, model_runner.PendingRun.result

    def execute_and_queue(*a, **kw):
        run = execute_graph(*a, **kw)
        run.ready_at = device.enqueue()
        return run

    def waited_result(self):
        device.wait(getattr(self, "ready_at", 0.0))
        return result(self)

    runner._execute_graph = execute_and_queue
    model_runner.PendingRun.result = waited_result
    launch, num_ahead = runner.launch, [0]

    def counting_launch(sched_out, after=None):
        num_ahead[0] += after is not None
        return launch(sched_out, after)

    runner.launch = counting_launch

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

    def decode_steps_ms(setting: tuple[bool, bool]) -> tuple[list[float], list[list[int]]]:
        engine.overlap_outputs, engine.schedule_ahead = setting
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
            medians: dict[tuple, list[float]] = {setting: [] for setting in SETTINGS}
            tokens: dict[tuple, list[list[int]]] = {}
            for _ in range(args.rounds):
                for setting in SETTINGS:
                    steps, tokens[setting] = decode_steps_ms(setting)
                    medians[setting].append(statistics.median(steps))
            if any(tokens[setting] != tokens[SETTINGS[0]] for setting in SETTINGS):
                raise SystemExit("overlap_outputs or schedule_ahead changed the generated tokens")
            rows.append((seconds, *(statistics.median(medians[setting]) for setting in SETTINGS)))
    finally:
        model_runner.PendingRun.result = result
    print(f"Decode step ms (median of {args.rounds} runs' medians, {args.max_tokens} tokens each), batch {args.batch}, "
          f"{args.adapters} adapters, stand-in device; the same tokens in every setting:\n")
    print("| device ms per step | both off | overlap_outputs | + schedule_ahead | overlap / off | both / off |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for seconds, off, overlap, ahead in rows:
        print(f"| {seconds:.1f} | {off:.3f} | {overlap:.3f} | {ahead:.3f} | {overlap / off:.2f} | {ahead / off:.2f} |")
    print(f"\nsteps launched ahead (schedule_ahead, all runs): {num_ahead[0]}")
    return 0


# (overlap_outputs, schedule_ahead), run in turn within each round
SETTINGS = ((False, False), (True, False), (True, True))


if __name__ == "__main__":
    raise SystemExit(main())
