"""The sampler's draw with top-k / top-p: ordering only the tokens that can survive against a full sort.

    .venv/bin/python benchmarks/bench_top_k.py [--rows 64 256] [--vocab 49152 151936] [--calls 5]

A sampled row's draw (``Sampler._sample_random``: temperature, min_p, top-k, top-p, softmax,
the race's noise, argmax) needs its tokens best first for top-k and top-p. Rows with a top_k of
at most the sampler's ``partial_top_k_max`` (``PARTIAL_TOP_K_MAX`` by default) draw among the
``topk`` of the batch's largest top_k (``_draw_among_best``); on the CPU, rows of top_p alone
try that many best tokens first (``top_k_top_p.apply_top_k_top_p``; tests/engine/test_sampler.py
checks both against the rule). This times the whole draw both ways on the same logits, side by
side, on CUDA when there is one (where top_p alone is always sorted in full), else on the CPU
(all its threads): "full sort" is a sampler with ``partial_top_k_max=0`` (every row sorted and
drawn over the whole vocabulary). The settings are Qwen2.5-Instruct's generation config
(temperature 0.7, top_k 20, top_p 0.8), a top_k of 50 alone, top_k 1000 with top_p 0.95, and
top_p 0.9 alone; unseeded. The logits are drawn from N(0, 4^2), so a top_p 0.9 nucleus holds
tens to hundreds of tokens (printed); a model's are often more peaked. Median of ``--calls``
calls each, the two alternating.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

SETTINGS = [("top_k 20, top_p 0.8", 20, 0.8), ("top_k 50", 50, 1.0), ("top_k 1000, top_p 0.95", 1000, 0.95),
            ("top_p 0.9", 0, 0.9)]


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    p.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936], help="SmolLM2's, Qwen2.5's")
    p.add_argument("--calls", type=int, default=5)
    return p.parse_args()


def main() -> None:
    import torch

    from loraplex.engine import top_k_top_p as filters
    from loraplex.engine.sampler import Sampler
    from loraplex.sampling_params import SamplingParams

    args = _parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    samplers = {"sort": Sampler(seed=0, device=device, partial_top_k_max=0),
                "partial": Sampler(seed=0, device=device)}

    def timed(way: str, logits, seqs) -> float:
        sampler = samplers[way]
        sync()
        start = time.perf_counter()
        sampler._sample_random(logits, seqs, {})
        sync()
        return (time.perf_counter() - start) * 1e3

    print(f"device: {device}, torch threads: {torch.get_num_threads()}")
    print(f"{'rows':>5} {'vocab':>7} {'setting':<24} | {'full sort ms':>12} | {'partial ms':>13} | {'ratio':>6}")
    for rows in args.rows:
        for vocab in args.vocab:
            logits = torch.randn(rows, vocab, device=device) * 4
            nucleus = torch.isfinite(filters.apply_top_k_top_p(logits[:8].clone(), [0] * 8, [0.9] * 8)).sum(1)
            print(f"  (rows {rows}, vocab {vocab}: top_p 0.9 keeps {int(nucleus.median())} tokens, median of 8 rows)")
            for name, k, p in SETTINGS:
                params = SamplingParams(temperature=0.7, top_k=k, top_p=p)
                seqs = [SimpleNamespace(params=params, output_token_ids=[]) for _ in range(rows)]
                timed("partial", logits, seqs)  # warm-up (CUDA: kernels, allocator)
                times: dict[str, list[float]] = {"sort": [], "partial": []}
                for _ in range(args.calls):
                    times["sort"].append(timed("sort", logits, seqs))
                    times["partial"].append(timed("partial", logits, seqs))
                full, part = statistics.median(times["sort"]), statistics.median(times["partial"])
                print(f"{rows:>5} {vocab:>7} {name:<24} | {full:>12.2f} | {part:>13.2f} | {part / full:>6.3f}")


if __name__ == "__main__":
    main()
