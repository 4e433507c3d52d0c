"""Output tokens per second with n-gram speculative decoding on and off, on a workload whose
answers copy their prompt (the case prompt lookup is for), same prompts, same process.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_spec_decode.py [--batches 1 8 --rounds 3]

SmolLM2-135M-Instruct (the default model), float32, greedy, ``--max-tokens`` output tokens at
most. Each prompt asks the model to repeat a short code or prose passage; greedy outputs are
identical with speculation on and off (checked every round), so both sides produce the same
tokens. One engine per side; each side is warmed up once, then the rounds run the sides in
turn, alternating which goes first; the table gives each side's median output tok/s, the median
of the per-round ratios, and the draft acceptance rate (accepted / proposed draft tokens) and
tokens per verifying step (1 + accepted / drafts).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

PASSAGES = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n",
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun all afternoon.",
    '{"name": "Alice", "age": 30, "city": "Paris", "tags": ["admin", "editor"], "active": true}',
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'is even')\n    else:\n        print(i, 'is odd')\n",
    "Water boils at one hundred degrees Celsius at sea level, and freezes at zero degrees Celsius.",
    "SELECT id, name, email FROM users WHERE active = 1 AND created_at > '2024-01-01' ORDER BY name;",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "Roses are red, violets are blue, sugar is sweet, and so are you. The end of the little poem.",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def conversations(batch: int) -> list[list[dict]]:
    return [[{"role": "user", "content": "Repeat the following text exactly, with nothing else:\n\n"
              + PASSAGES[i % len(PASSAGES)]}] for i in range(batch)]


def run(llm, convs, params) -> tuple[float, list[list[int]], dict]:
    before = llm.engine.stats()
    t0 = time.perf_counter()
    outs = llm.chat(convs, params)
    seconds = time.perf_counter() - t0
    after = llm.engine.stats()
    spec = {k: after[k] - before[k] for k in after if k.startswith("spec_decode_")}
    tokens = [o.token_ids for o in outs]
    return sum(map(len, tokens)) / seconds, tokens, spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    from loraplex.engine.llm import LLM
    from loraplex.sampling_params import SamplingParams

    spec_config = {**NGRAM, "num_speculative_tokens": args.k}
    common = dict(model=args.model, dtype="float32", device="cpu", kv_cache_bytes=256 << 20)
    sides = {"plain": LLM(**common), "spec": LLM(**common, speculative_config=spec_config)}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    print(f"| batch | plain tok/s | ngram k={args.k} tok/s | ratio | acceptance | tokens/step | round ratios |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for batch in args.batches:
        convs = conversations(batch)
        for llm in sides.values():
            run(llm, convs, params)  # warm-up
        tps: dict[str, list[float]] = {name: [] for name in sides}
        ratios, spec_totals = [], {}
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            results = {name: run(sides[name], convs, params) for name in order}
            if results["spec"][1] != results["plain"][1]:
                raise SystemExit("speculative outputs differ from plain greedy outputs")
            for name, (rate, _, _) in results.items():
                tps[name].append(rate)
            ratios.append(results["spec"][0] / results["plain"][0])
            for key, value in results["spec"][2].items():
                spec_totals[key] = spec_totals.get(key, 0) + value
        drafts = spec_totals.get("spec_decode_num_drafts", 0)
        proposed = spec_totals.get("spec_decode_num_draft_tokens", 0)
        accepted = spec_totals.get("spec_decode_num_accepted_tokens", 0)
        print(f"| {batch} | {statistics.median(tps['plain']):.1f} | {statistics.median(tps['spec']):.1f} | "
              f"{statistics.median(ratios):.2f}x | {accepted / max(proposed, 1):.0%} | "
              f"{1 + accepted / max(drafts, 1):.2f} | {', '.join(f'{r:.2f}' for r in ratios)} |", flush=True)


if __name__ == "__main__":
    main()
