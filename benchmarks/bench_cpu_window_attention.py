"""CPU paged attention of a decode batch per layer kind: full causal, Gemma 2's soft-cap, a
sliding window, and both (the windowed layers gather only the window's blocks).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_cpu_window_attention.py [--seqs 16 --context 4096]

Defaults are gemma-2-2b's attention shapes (8 heads over 4 KV heads, head_dim 256, bf16) with a
window of 512 (gemma-3-1b's). One plan per step, as the model builds it; median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from loraplex.kernels.attention_cpu import paged_attention_cpu, plan_paged_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--softcap", type=float, default=50.0)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bs, per_seq = args.block_size, -(-args.context // args.block_size)
    num_blocks = args.seqs * per_seq
    cache = torch.randn(2, num_blocks, bs, args.kv_heads, args.head_dim, dtype=torch.bfloat16)
    tables = torch.randperm(num_blocks).view(args.seqs, per_seq).to(torch.int32)
    seq_lens = torch.full((args.seqs,), args.context, dtype=torch.int32)
    starts = torch.arange(args.seqs + 1, dtype=torch.int32)
    query = torch.randn(args.seqs, args.heads, args.head_dim, dtype=torch.bfloat16)
    plan = plan_paged_attention(tables, seq_lens, starts, bs)
    print(f"{args.seqs} decodes x {args.context} context, {args.heads}/{args.kv_heads} heads, "
          f"head_dim {args.head_dim}, bf16, {args.threads} threads")
    print("| layer | ms (median) |\n| --- | --- |")
    for window in (None, args.window):
        for softcap in (None, args.softcap):
            def run():
                paged_attention_cpu(query, cache, tables, seq_lens, starts, args.head_dim**-0.5, 1, args.context,
                                    plan, sliding_window=window, softcap=softcap)
            run()
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                run()
                times.append((time.perf_counter() - t0) * 1e3)
            print(f"| window {window}, softcap {softcap} | {statistics.median(times):.1f} |")


if __name__ == "__main__":
    main()
