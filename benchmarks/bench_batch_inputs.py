"""Host CPU of ``ModelRunner.prepare_batch`` for decode steps: the step's tokens, positions,
slots and block tables, at long contexts without computing them.

    .venv/bin/python benchmarks/bench_batch_inputs.py [--batch 256] [--context 32 1000 4000 16000]

A tiny random Llama runner (the model never runs) and ``batch`` sequences of ``context`` tokens
with made-up block tables; each measured step advances every sequence by one token, as decoding
does (a new block every ``block_size`` steps), and calls ``prepare_batch``. Prints the 10th
percentile and median of the thread CPU time per step over 300 steps. Runs in any checkout
whose ``prepare_batch`` takes a list of ``ScheduledSeq`` (to compare two versions).
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

STEPS = 300


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, nargs="+", default=[32, 1000, 4000, 16000])
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args()
    import torch

    from loraplex.config import EngineConfig
    from loraplex.engine.model_runner import ModelRunner
    from loraplex.engine.outputs import ScheduledSeq
    from loraplex.engine.sequence import Sequence, SequenceStatus
    from loraplex.sampling_params import SamplingParams
    from tests.fixtures.tiny_models import make_tiny_model_dir

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="loraplex-bench-inputs-"))
    max_len = max(args.context) + STEPS + 16
    model_dir = make_tiny_model_dir(root / "model", "llama", num_hidden_layers=1, hidden_size=32,
                                    intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                                    max_position_embeddings=max_len)
    runner = ModelRunner(EngineConfig(model=str(model_dir), dtype="float32", device="cpu", home=root / "home",
                                      max_num_seqs=args.batch, max_model_len=max_len, kv_cache_bytes=1 << 26,
                                      block_size=args.block_size))
    bs = args.block_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0)
    print(f"# prepare_batch thread CPU per decode step, {args.batch} sequences, blocks of {bs}")
    print("| context | ms p10 | ms median |")
    print("| ---: | ---: | ---: |")
    for context in args.context:
        seqs = []
        for i in range(args.batch):
            seq = Sequence(i, str(i), [rng.randrange(4, 250) for _ in range(context)], params)
            seq.status = SequenceStatus.RUNNING
            seq.output_token_ids.append(rng.randrange(4, 250))
            seq.num_computed_tokens = context
            seq.block_tables = [[rng.randrange(runner.num_blocks) for _ in range(-(-(context + 1) // bs))]]
            seqs.append(seq)
        times = []
        gc.collect()
        for _ in range(STEPS + 5):
            scheduled = [ScheduledSeq(s, s.num_computed_tokens, 1, s.block_tables[0], True, None,
                                      block_tables=s.block_tables) for s in seqs]
            start = time.thread_time()
            runner.prepare_batch(scheduled)
            times.append(time.thread_time() - start)
            for s in seqs:  # the token was computed and a new one sampled
                s.num_computed_tokens += 1
                s.output_token_ids.append(rng.randrange(4, 250))
                if s.num_computed_tokens % bs == 0:
                    s.block_tables[0].append(rng.randrange(runner.num_blocks))
        runner.release([s.seq_id for s in seqs])
        times = sorted(times[5:])
        print(f"| {context} | {times[len(times) // 10] * 1e3:.3f} | {times[len(times) // 2] * 1e3:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
