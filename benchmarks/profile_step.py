"""Where one engine step spends its time: the base benchmark's workload (bench_engine.py), with
``torch.profiler`` around the first step (a 2048-token prefill) and a 64-sequence decode step.

    .venv/bin/python benchmarks/profile_step.py [--dtype float32] [--step 10]

Prints per step: wall time, the GEMMs (oneDNN linear), paged attention (block gather + SDPA),
and everything else.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

GEMM = {"mkldnn::_linear_pointwise", "aten::addmm", "aten::mm"}
ATTENTION = {"aten::index_select", "aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::_scaled_dot_product_attention_math"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--step", type=int, default=10, help="which decode step to profile")
    parser.add_argument("--home", default="~/.loraplex")
    args = parser.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from bench_engine import chat_token_ids, make_prompts
    from loraplex import LLM, SamplingParams
    from loraplex.model.loader import load_tokenizer, resolve_model_dir

    home = Path(args.home).expanduser()
    model_dir, _ = resolve_model_dir("smollm2", home)
    prompt_ids = chat_token_ids(load_tokenizer(model_dir), make_prompts(64))
    llm = LLM(model="smollm2", dtype=args.dtype, home=home, max_model_len=1024, max_num_seqs=256)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm.generate(prompt_ids, params)  # warm-up
    runner = llm.engine.runner
    execute, count, rows = runner.execute, [0], []

    def profiled(sched_out):
        count[0] += 1
        if count[0] not in (1, args.step):
            return execute(sched_out)
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = execute(sched_out)
        wall = time.perf_counter() - start
        self_ms = {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}
        tokens = sum(item.num_tokens for item in sched_out.scheduled)
        gemm = sum(v for k, v in self_ms.items() if k in GEMM)
        attention = sum(v for k, v in self_ms.items() if k in ATTENTION)
        rows.append((count[0], tokens, wall * 1e3, sum(self_ms.values()), gemm, attention))
        return out

    runner.execute = profiled
    llm.reset_prefix_cache()  # as bench_engine.py: only the chat template's prefix is shared
    llm.generate(prompt_ids, params)
    print("| step | tokens | wall ms | profiled ms | GEMM ms | attention ms | other ms |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for step, tokens, wall, total, gemm, attention in rows:
        print(f"| {step} | {tokens} | {wall:.1f} | {total:.1f} | {gemm:.1f} ({gemm / total:.0%}) | "
              f"{attention:.1f} | {total - gemm - attention:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
