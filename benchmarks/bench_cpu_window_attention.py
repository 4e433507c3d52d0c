"""CPU paged attention per layer kind: full causal, Gemma 2's soft-cap, a sliding window, and
both; for a decode batch and for prompt chunks at the end of a long context (the windowed layers
gather only the window's blocks).

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


def _median_ms(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=16, help="decode rows")
    parser.add_argument("--prefill-seqs", type=int, default=2, help="prompt chunks (0: no prefill rows)")
    parser.add_argument("--chunk", type=int, default=512, help="tokens per prompt chunk")
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
    print(f"context {args.context}, {args.heads}/{args.kv_heads} heads, head_dim {args.head_dim}, bf16, "
          f"{args.threads} threads")
    print("| batch | layer | ms (median) |\n| --- | --- | --- |")
    batches = [(f"{args.seqs} decodes", args.seqs, 1)]
    if args.prefill_seqs:
        batches.append((f"{args.prefill_seqs} chunks of {args.chunk}", args.prefill_seqs, args.chunk))
    for label, num_seqs, q_len in batches:
        num_blocks = num_seqs * per_seq
        cache = torch.randn(2, num_blocks, bs, args.kv_heads, args.head_dim, dtype=torch.bfloat16)
        tables = torch.randperm(num_blocks).view(num_seqs, per_seq).to(torch.int32)
        seq_lens = torch.full((num_seqs,), args.context, dtype=torch.int32)
        starts = torch.arange(num_seqs + 1, dtype=torch.int32) * q_len
        query = torch.randn(num_seqs * q_len, args.heads, args.head_dim, dtype=torch.bfloat16)
        plan = plan_paged_attention(tables, seq_lens, starts, bs)
        for window in (None, args.window):
            for softcap in (None, args.softcap):
                def run():
                    paged_attention_cpu(query, cache, tables, seq_lens, starts, args.head_dim**-0.5, q_len,
                                        args.context, plan, sliding_window=window, softcap=softcap)
                print(f"| {label} | window {window}, softcap {softcap} | {_median_ms(run, args.repeats):.1f} |")


if __name__ == "__main__":
    main()
