"""How many long sequences run at once on a fixed KV budget, with and without freeing the blocks
that slid out of a sliding window (the scheduler and block manager alone; no model, every
sampled token is a constant).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_window_concurrency.py [--kv-tokens 131072]

Defaults are Mistral-7B v0.1's window (4096) with 16-token blocks: 64 requests of 16k-token
prompts and 256 generated tokens each, a KV budget of 128k tokens (8192 blocks; about 16 GiB
of Mistral-7B's bf16 KV), 8192 tokens a step, at most 256 running sequences.
"""

from __future__ import annotations

import argparse

from loraplex.config import EngineConfig
from loraplex.engine.block_manager import BlockManager
from loraplex.engine.outputs import ModelRunnerOutput, SampledToken
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.sequence import Sequence
from loraplex.sampling_params import SamplingParams


def run(args, window: int | None) -> dict:
    config = EngineConfig(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.batched_tokens, enable_prefix_caching=False)
    num_blocks = args.kv_tokens // args.block_size
    bm = BlockManager(num_blocks, args.block_size, sliding_window=window)
    sched = Scheduler(config, bm, max_model_len=args.prompt + args.output + 1)
    params = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)
    for i in range(args.requests):  # distinct first tokens: no two prompts are alike
        sched.add(Sequence(seq_id=i, request_id=str(i), prompt_token_ids=[i] + [7] * (args.prompt - 1),
                           params=params, arrival_time=float(i)))
    steps = most_running = most_decoding = 0
    while sched.has_unfinished():
        out = sched.schedule()
        sampled = {e.seq.seq_id: SampledToken(5) for e in out.scheduled if e.needs_sample}
        sched.update(out, ModelRunnerOutput(sampled=sampled))
        steps += 1
        most_running = max(most_running, sched.num_running)
        most_decoding = max(most_decoding, sum(1 for e in out.scheduled if e.num_tokens == 1))
    assert bm.num_free_blocks == num_blocks
    return dict(steps=steps, most_running=most_running, most_decoding=most_decoding,
                preemptions=sched.stats.num_preemptions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-tokens", type=int, default=131072)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=16384)
    parser.add_argument("--output", type=int, default=256)
    parser.add_argument("--batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    args = parser.parse_args()
    print(f"{args.requests} requests x ({args.prompt} prompt + {args.output} out), window {args.window}, "
          f"KV {args.kv_tokens} tokens in {args.block_size}-token blocks")
    print("| blocks | steps | most running | most decoding in a step | preemptions |\n| --- | --- | --- | --- | --- |")
    for label, window in (("all kept", None), ("out-of-window freed", args.window)):
        r = run(args, window)
        print(f"| {label} | {r['steps']} | {r['most_running']} | {r['most_decoding']} | {r['preemptions']} |")


if __name__ == "__main__":
    main()
