"""How many long sequences of a model with both windowed and global layers (Gemma 3's shape) run
at once on a fixed KV budget: every layer keeping every block (one group, as before layer groups)
against layer groups whose windowed groups give back the pages before their window (the
scheduler and block manager alone; no model, every sampled token is a constant).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_hybrid_kv_concurrency.py [--kv-tokens 131072]

Defaults are Gemma 3 27B's layers (62, every sixth global, window 1024) with 16-token blocks: 64
requests of 32k-token prompts and 256 generated tokens each, a KV budget of what 128k tokens of
all 62 layers take (about 62 GiB of Gemma 3 27B's bf16 KV), 8192 tokens a step, at most 256
running sequences. The same bytes make ``62 / group_size`` times as many pages with groups.
"""

from __future__ import annotations

import argparse

from loraplex.config import EngineConfig
from loraplex.engine.block_manager import BlockManager
from loraplex.engine.kv_layout import KVLayout
from loraplex.engine.outputs import ModelRunnerOutput, SampledToken
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.sequence import Sequence
from loraplex.sampling_params import SamplingParams


def run(args, layout: KVLayout) -> dict:
    config = EngineConfig(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.batched_tokens, enable_prefix_caching=False)
    # the budget in one-layer blocks, split into pages of group_size layers
    num_pages = args.kv_tokens // args.block_size * args.layers // layout.group_size
    bm = BlockManager(num_pages, args.block_size, group_windows=layout.group_windows)
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
    assert bm.num_free_blocks == num_pages
    return dict(pages=num_pages, steps=steps, most_running=most_running, most_decoding=most_decoding,
                preemptions=sched.stats.num_preemptions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=62)
    parser.add_argument("--global-every", type=int, default=6, help="layer i is global when (i + 1) %% N == 0")
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-tokens", type=int, default=131072, help="the budget: tokens of all layers' KV")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32768)
    parser.add_argument("--output", type=int, default=256)
    parser.add_argument("--batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    args = parser.parse_args()
    windows = [None if (i + 1) % args.global_every == 0 else args.window for i in range(args.layers)]
    grouped = KVLayout.from_layer_windows(windows)
    print(f"{args.requests} requests x ({args.prompt} prompt + {args.output} out), {args.layers} layers "
          f"({windows.count(None)} global), window {args.window}, KV of {args.kv_tokens} tokens x all layers "
          f"in {args.block_size}-token blocks")
    print("| KV layout | pages | steps | most running | most decoding in a step | preemptions |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for label, layout in (("one group, all blocks kept", KVLayout.single(args.layers)),
                          (f"{grouped.num_groups} groups of {grouped.group_size} layers", grouped)):
        r = run(args, layout)
        print(f"| {label} | {r['pages']} | {r['steps']} | {r['most_running']} | {r['most_decoding']} | "
              f"{r['preemptions']} |")


if __name__ == "__main__":
    main()
