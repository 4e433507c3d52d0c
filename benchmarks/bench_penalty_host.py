"""Host time of the sampler's penalties per step: prompts uploaded each step against kept on the
device, and output tokens converted from each row's list against grown in its ``TokenHistory``.

    .venv/bin/python benchmarks/bench_penalty_host.py [--rows 64 256] [--prompt 200 1000 4000]
        [--output 100 1000 4000]

Every row has a repetition penalty (which reads the prompt) and a frequency penalty. The logits
live on PyTorch's ``meta`` device, where operations compute shapes only: what is timed is the
host's part (Python, numpy, the dispatcher), which on a GPU is what the step waits for, not the
arithmetic, which this machine's CPU would dominate. Thread CPU time per call, 10th percentile
and median over ``--calls`` calls; the two ways alternate call by call so that drift on a shared
VM falls on both alike.

First table, 100 output tokens a row: "uploaded each step" is ``apply_penalties`` with a fresh
``PromptTokens`` each call: every prompt goes up for that step alone, as before ``PromptTokens``
(which padded them into one array instead). A meta operation costs more host time than a CUDA
launch (its shape rules run in Python; ``torch.cat`` of many tensors most), so the fixed part of
both columns is overstated, "kept on device" (a cat of the rows' prompts) the more.

Second table, 200-token prompts kept, ``--output`` tokens a row, each step one more: "lists" are
rows that are not ``Sequence`` objects (as a speculative step's position views), whose output
list is converted whole; "histories" are ``Sequence`` rows, whose ``TokenHistory`` converts the
one new token.
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
OUTPUT_TOKENS = 100  # the first table's
OUTPUT_TABLE_PROMPT = 200  # the second table's


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256], help="penalized rows per step")
    p.add_argument("--prompt", type=int, nargs="+", default=[200, 1000, 4000], help="prompt tokens per row")
    p.add_argument("--output", type=int, nargs="+", default=[100, 1000, 4000], help="output tokens per row")
    p.add_argument("--calls", type=int, default=40)
    return p.parse_args()


def _rows(num_rows: int, prompt_len: int, output_len: int, rng: random.Random) -> list:
    from loraplex.sampling_params import SamplingParams

    params = SamplingParams(repetition_penalty=1.1, frequency_penalty=0.2)
    return [SimpleNamespace(params=params, seq_id=i, prompt_token_ids=[rng.randrange(VOCAB) for _ in range(prompt_len)],
                            output_token_ids=[rng.randrange(VOCAB) for _ in range(output_len)])
            for i in range(num_rows)]


def _as_sequences(rows: list) -> list:
    from loraplex.engine.sequence import Sequence

    seqs = [Sequence(row.seq_id, f"r{row.seq_id}", row.prompt_token_ids, row.params) for row in rows]
    for seq, row in zip(seqs, rows):
        seq.output_token_ids = list(row.output_token_ids)
    return seqs


def _timed_pair(calls: int, ways: dict, before_each=None) -> dict[str, tuple[float, float]]:
    """(p10, median) thread-CPU ms of each of ``ways`` (name -> call), alternating call by call;
    ``before_each`` runs untimed before each round."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(calls):
        if before_each is not None:
            before_each()
        for name, call in ways.items():
            start = time.thread_time()
            call()
            times[name].append((time.thread_time() - start) * 1e3)
    return {k: (statistics.quantiles(v, n=10)[0], statistics.median(v)) for k, v in times.items()}


def _print_row(label: str, stats: dict, first: str, second: str) -> None:
    print(f"{label} | {stats[first][0]:>16.2f} / {stats[first][1]:>18.2f} | "
          f"{stats[second][0]:>14.2f} / {stats[second][1]:>16.2f} | {stats[second][1] / stats[first][1]:>12.2f}")


def main() -> None:
    import torch

    from loraplex.engine.penalties import PromptTokens, apply_penalties

    args = _parse_args()
    rng = random.Random(0)
    print(f"{'rows':>5} {'prompt':>7} | {'uploaded each step (p10 / median ms)':>37} | "
          f"{'kept on device (p10 / median ms)':>33} | {'median ratio':>12}")
    for num_rows in args.rows:
        for prompt_len in args.prompt:
            seqs = _rows(num_rows, prompt_len, OUTPUT_TOKENS, rng)
            logits = torch.empty(num_rows, VOCAB, device="meta")
            kept = PromptTokens()
            apply_penalties(logits, seqs, kept)  # the first step uploads them
            stats = _timed_pair(args.calls, {"each": lambda: apply_penalties(logits, seqs, PromptTokens()),
                                             "kept": lambda: apply_penalties(logits, seqs, kept)})
            _print_row(f"{num_rows:>5} {prompt_len:>7}", stats, "each", "kept")
    print()
    print(f"{'rows':>5} {'output':>7} | {'lists (p10 / median ms)':>37} | "
          f"{'histories (p10 / median ms)':>33} | {'median ratio':>12}")
    for num_rows in args.rows:
        for output_len in args.output:
            lists = _rows(num_rows, OUTPUT_TABLE_PROMPT, output_len, rng)
            sequences = _as_sequences(lists)
            logits = torch.empty(num_rows, VOCAB, device="meta")
            kept = {"lists": PromptTokens(), "histories": PromptTokens()}
            for name, rows in (("lists", lists), ("histories", sequences)):
                apply_penalties(logits, rows, kept[name])  # prompts up, histories built

            def one_more_token():
                for row, seq in zip(lists, sequences):
                    token = rng.randrange(VOCAB)
                    row.output_token_ids.append(token)
                    seq.output_token_ids.append(token)

            stats = _timed_pair(args.calls, {"lists": lambda: apply_penalties(logits, lists, kept["lists"]),
                                             "histories": lambda: apply_penalties(logits, sequences, kept["histories"])},
                                before_each=one_more_token)
            _print_row(f"{num_rows:>5} {output_len:>7}", stats, "lists", "histories")


if __name__ == "__main__":
    main()
