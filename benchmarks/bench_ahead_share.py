"""How many steps ``schedule_ahead`` launches ahead under serving load, on any machine.

    .venv/bin/python benchmarks/bench_ahead_share.py [--users 100 200] [--steps 600]

A step can go ahead only from a step the scheduler would run again (schedule_ahead.py); how
often that holds is a property of the workload and the scheduler, not of the device, so this
runs the engine (overlap_outputs and schedule_ahead on, the server's default token budget of
2048 and 256 seats) over the test suite's fake paged runner, which computes nothing but checks
every step's KV slots. Closed-loop users stream requests of 32 generated tokens (greedy); a user
sends its next request as soon as one ends. Prompt lengths are drawn uniformly from each row's
range, so longer prompts are cut into more chunks. Prints, per workload, the steps run, the
share launched ahead, and the share of steps that held a prompt chunk short of its prompt's end.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install

PROMPT_RANGES = [(20, 200), (200, 1500), (1000, 6000)]


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, nargs="+", default=[100, 200], help="requests kept in flight")
    p.add_argument("--steps", type=int, default=600, help="engine steps per workload")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    return p.parse_args()


def run_workload(users: int, prompt_range: tuple[int, int], steps: int, budget: int) -> tuple[int, int, int]:
    """(steps run, steps launched ahead, steps with a chunk short of its prompt's end)."""
    from loraplex.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.sampling_params import SamplingParams
    from tests.engine.scheduler_harness import FakeModelRunner

    block_size = 16
    longest = prompt_range[1] + 64
    num_blocks = users * -(-longest // block_size) + 64  # room for every user's longest request
    runner = FakeModelRunner(num_blocks=num_blocks, block_size=block_size, max_model_len=longest)
    config = EngineConfig(block_size=block_size, overlap_outputs=True, schedule_ahead=True, max_num_seqs=256,
                          max_num_batched_tokens=budget, max_model_len=longest)
    engine = LLMEngine(config, runner=runner)
    rng = random.Random(users * 7 + prompt_range[0])
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    launched, chunked = [], []
    launch = runner.launch

    def counting_launch(out, after=None):
        launched.append(after is not None)
        chunked.append(out.num_chunked_prefills > 0)
        return launch(out, after)

    runner.launch = counting_launch
    next_id = 0

    def send() -> None:
        nonlocal next_id
        prompt = [rng.randrange(4, 97) for _ in range(rng.randint(*prompt_range))]
        engine.add_request(f"r{next_id}", prompt, params)
        next_id += 1

    for _ in range(users):
        send()
    for _ in range(steps):
        for out in engine.step():
            if out.finished:
                send()
    return len(launched), sum(launched), sum(chunked)


def main() -> int:
    args = _parse_args()
    print(f"Steps launched ahead (schedule_ahead), fake runner, token budget {args.max_num_batched_tokens}, "
          f"{args.steps} steps each, 32 generated tokens per request:\n")
    print("| users | prompt tokens | steps | launched ahead | steps with a prompt chunk cut short |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for users in args.users:
        for prompt_range in PROMPT_RANGES:
            total, ahead, chunked = run_workload(users, prompt_range, args.steps, args.max_num_batched_tokens)
            print(f"| {users} | {prompt_range[0]}-{prompt_range[1]} | {total} | {ahead / total:.1%} | "
                  f"{chunked / total:.1%} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
