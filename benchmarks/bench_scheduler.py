"""Host time of ``Scheduler.schedule()`` with a long waiting queue, this checkout against a baseline.

    .venv/bin/python benchmarks/bench_scheduler.py [--waiting 1000 10000] [--tenants 1 10 100]
        [--policies fair fcfs priority] [--steps 300] [--baseline f41ac9d]

The baseline is the scheduler module at a git revision (by default the last one with the
list-based waiting queue, which ordered every waiting sequence each step), loaded next to this
checkout's from ``git show`` so both run in this process on this checkout's block manager.
Each configuration runs the same workload on both sides: ``max_num_seqs`` 128 sequences decode
with KV memory nearly full, so a step admits one or two (as running ones finish) or none; the
waiting queue is topped up to ``--waiting`` after each step, spread round-robin over
``--tenants`` tenants of weights 1 and 2 (priorities 0-2 under ``priority``). Only
``schedule()`` is timed, as CPU time of the thread (on a shared machine, wall-clock 90th
percentiles measured the other processes' time slices); the sides take turns step by step so
that drift hits both alike. Prints median and 90th percentile per call and the ratio of
medians. No GPU, no torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install

from loraplex.config import EngineConfig  # noqa: E402
from loraplex.engine.block_manager import BlockManager  # noqa: E402
from loraplex.engine.outputs import ModelRunnerOutput, SampledToken  # noqa: E402
from loraplex.engine.scheduler import Scheduler  # noqa: E402
from loraplex.engine.sequence import Sequence  # noqa: E402
from loraplex.sampling_params import SamplingParams  # noqa: E402

MAX_NUM_SEQS = 128
BLOCK_SIZE = 16
PROMPT_TOKENS = 16
MAX_TOKENS = (8, 56)  # a sequence holds 2-5 blocks (3.5 on average)
KV_BLOCKS = 2 * MAX_NUM_SEQS  # KV, not max_num_seqs, stops admission
WARMUP_STEPS = 40


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--waiting", type=int, nargs="+", default=[1000, 10000], help="waiting sequences kept queued")
    p.add_argument("--tenants", type=int, nargs="+", default=[1, 10, 100], help="tenants the waiting ones belong to")
    p.add_argument("--policies", nargs="+", default=["fair", "fcfs", "priority"])
    p.add_argument("--steps", type=int, default=300, help="schedule() calls timed per side and configuration")
    p.add_argument("--baseline", default="f41ac9d", help="git revision of the baseline scheduler")
    return p.parse_args()


def _load_baseline(revision: str) -> type:
    """The Scheduler class of loraplex/engine/scheduler.py at ``revision``."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:loraplex/engine/scheduler.py"],
                            check=True, capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader("baseline_scheduler", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    exec(compile(source, f"{revision}:loraplex/engine/scheduler.py", "exec"), module.__dict__)
    return module.Scheduler


class _Side:
    """One scheduler with its workload: seeded alike on both sides, so both see the same steps."""

    def __init__(self, scheduler_cls: type, policy: str, num_waiting: int, num_tenants: int):
        config = EngineConfig(block_size=BLOCK_SIZE, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=2048,
                              scheduling_policy=policy, enable_prefix_caching=False)
        self.scheduler = scheduler_cls(config, BlockManager(KV_BLOCKS, BLOCK_SIZE))
        self.policy, self.num_waiting, self.num_tenants = policy, num_waiting, num_tenants
        self.rng = random.Random(0)
        self.next_id = 0
        self.times_ns: list[int] = []
        self._top_up()

    def _top_up(self) -> None:
        while self.scheduler.num_waiting < self.num_waiting:
            i = self.next_id
            self.next_id += 1
            tenant = f"t{i % self.num_tenants}"
            prompt = [self.rng.randrange(4, 90) for _ in range(PROMPT_TOKENS)]
            self.scheduler.add(Sequence(
                seq_id=i, request_id=f"r{i}", prompt_token_ids=prompt,
                params=SamplingParams(max_tokens=self.rng.randint(*MAX_TOKENS), ignore_eos=True),
                tenant=tenant, tenant_weight=1.0 + i % self.num_tenants % 2,
                priority=self.rng.randint(0, 2) if self.policy == "priority" else 0, arrival_time=float(i)))

    def step(self, timed: bool) -> int:
        start = time.thread_time_ns()
        out = self.scheduler.schedule()
        elapsed = time.thread_time_ns() - start
        if timed:
            self.times_ns.append(elapsed)
        sampled = {e.seq.seq_id: SampledToken(7) for e in out.scheduled if e.needs_sample}
        self.scheduler.update(out, ModelRunnerOutput(sampled=sampled))
        self._top_up()
        return sum(1 for e in out.scheduled if e.start_pos == 0)


def _ms(values: list[int], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] / 1e6


def main() -> int:
    args = _parse_args()
    baseline_cls = _load_baseline(args.baseline)
    print(f"schedule() host CPU time, ms per call: baseline {args.baseline} vs this checkout "
          f"({args.steps} calls per side, interleaved; {MAX_NUM_SEQS} running, KV nearly full)\n")
    print("| policy | waiting | tenants | admitted/step | baseline median | p90 | new median | p90 | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for policy in args.policies:
        for num_waiting in args.waiting:
            for num_tenants in args.tenants:
                old = _Side(baseline_cls, policy, num_waiting, num_tenants)
                new = _Side(Scheduler, policy, num_waiting, num_tenants)
                admitted = 0
                for i in range(WARMUP_STEPS + args.steps):
                    timed = i >= WARMUP_STEPS
                    first, second = (old, new) if i % 2 else (new, old)
                    got = first.step(timed), second.step(timed)
                    assert got[0] == got[1], "the two schedulers admitted differently"
                    admitted += got[0] if timed else 0
                old_median, new_median = statistics.median(old.times_ns) / 1e6, statistics.median(new.times_ns) / 1e6
                print(f"| {policy} | {num_waiting:,} | {num_tenants} | {admitted / args.steps:.1f} "
                      f"| {old_median:.3f} | {_ms(old.times_ns, 0.9):.3f} "
                      f"| {new_median:.3f} | {_ms(new.times_ns, 0.9):.3f} | {old_median / new_median:.1f}x |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
