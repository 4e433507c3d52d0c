"""Host time of the sampler's penalties per step: prompts uploaded each step against kept on the device.

    .venv/bin/python benchmarks/bench_penalty_host.py [--rows 64 256] [--prompt 200 1000 4000]

Every row has a repetition penalty (which reads the prompt) and 100 output tokens. The logits
live on PyTorch's ``meta`` device, where operations compute shapes only: what is timed is the
host's part (Python, numpy, the dispatcher), which on a GPU is what the step waits for, not the
arithmetic, which this machine's CPU would dominate. Thread CPU time per call, 10th percentile
and median over ``--calls`` calls; the two ways alternate call by call so that drift on a shared
VM falls on both alike. "uploaded each step" is ``apply_penalties`` with a fresh
``PromptTokens`` each call: every prompt goes up for that step alone, as before ``PromptTokens``
(which padded them into one array instead). A meta operation costs more host time than a CUDA
launch (its shape rules run in Python; ``torch.cat`` of many tensors most), so the fixed part of
both columns is overstated, "kept on device" (a cat of the rows' prompts) the more.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

VOCAB = 128_256  # Llama 3's
OUTPUT_TOKENS = 100


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256], help="penalized rows per step")
    p.add_argument("--prompt", type=int, nargs="+", default=[200, 1000, 4000], help="prompt tokens per row")
    p.add_argument("--calls", type=int, default=40)
    return p.parse_args()


def _rows(num_rows: int, prompt_len: int, rng: random.Random) -> list:
    from loraplex.sampling_params import SamplingParams

    params = SamplingParams(repetition_penalty=1.1, frequency_penalty=0.2)
    return [SimpleNamespace(params=params, seq_id=i, prompt_token_ids=[rng.randrange(VOCAB) for _ in range(prompt_len)],
                            output_token_ids=[rng.randrange(VOCAB) for _ in range(OUTPUT_TOKENS)])
            for i in range(num_rows)]


def main() -> None:
    import torch

    from loraplex.engine.penalties import PromptTokens, apply_penalties

    args = _parse_args()
    rng = random.Random(0)
    print(f"{'rows':>5} {'prompt':>7} | {'uploaded each step (p10 / median ms)':>37} | "
          f"{'kept on device (p10 / median ms)':>33} | {'median ratio':>12}")
    for num_rows in args.rows:
        for prompt_len in args.prompt:
            seqs = _rows(num_rows, prompt_len, rng)
            logits = torch.empty(num_rows, VOCAB, device="meta")
            kept = PromptTokens()
            apply_penalties(logits, seqs, kept)  # the first step uploads them
            times: dict[str, list[float]] = {"each": [], "kept": []}
            for _ in range(args.calls):
                for name, prompts in (("each", None), ("kept", kept)):
                    start = time.thread_time()
                    apply_penalties(logits, seqs, PromptTokens() if prompts is None else prompts)
                    times[name].append((time.thread_time() - start) * 1e3)
            stats = {k: (statistics.quantiles(v, n=10)[0], statistics.median(v)) for k, v in times.items()}
            print(f"{num_rows:>5} {prompt_len:>7} | {stats['each'][0]:>16.2f} / {stats['each'][1]:>18.2f} | "
                  f"{stats['kept'][0]:>14.2f} / {stats['kept'][1]:>16.2f} | "
                  f"{stats['kept'][1] / stats['each'][1]:>12.2f}")


if __name__ == "__main__":
    main()
