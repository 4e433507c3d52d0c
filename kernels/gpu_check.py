"""The GPU check: everything GPU-side for loraplex's kernels in one call (< 8 minutes, one H200).

    python kernels/gpu_check.py               # on the GPU machine, from the repository root
    python kernels/gpu_check.py --cpu-smoke   # tiny shapes under the Triton interpreter (CPU)

1. correctness: each Triton kernel in bf16 against its fp32 torch reference (check_kernels.py;
   the fused MoE kernels and a CUDA-graph replay of them in moe_lab.py, with expert LoRA in
   moe_lora_lab.py, with fp8 experts against fp32 on the dequantized experts in moe_fp8_lab.py)
2. timings: median times, achieved GB/s against a copy bandwidth measured in this run, the LoRA
   kernels against the base matmul, under a CUDA graph's padded metadata and on lm_head /
   embed_tokens (bench_kernels.py),
   the fused MoE kernels against the torch loop (moe_lab.py), with expert LoRA against without
   (moe_lora_lab.py), and fp8 experts against bf16 ones (moe_fp8_lab.py)
3. end to end: a random-weight Llama with Llama-3-8B layer shapes and fewer layers, batch 64 and
   256 with 0, 16, 64 and 128 distinct rank-16 adapters, tokens/s and LoRA overhead, each eager
   and with decode steps replayed from CUDA graphs (e2e_bench.py), a graph step split into host
   phases and its replay's device time by kernel group (step_phases.py); then what host misses cost
   the streams already decoding, adapters read on the engine thread against in the background
   (host_miss_bench.py)

Prints as it goes and writes ``$OUT/results.md`` when ``OUT`` is set. Exit status 1 when a
correctness check fails (timings never fail the run; targets are reported MET / MISSED).
``--cpu-smoke`` figures are interpreter wall times: they exercise the code, they are no GPU figure.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, Triton interpreter, CPU tensors")
    p.add_argument("--skip-bench", action="store_true", help="correctness only")
    p.add_argument("--skip-e2e", action="store_true", help="no end-to-end engine run")
    p.add_argument("--e2e-layers", type=int, default=4, help="decoder layers of the Llama-3-8B-shaped model")
    p.add_argument("--e2e-max-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--e2e-prompt-len", type=int, default=512, help="prompt tokens per request (context size)")
    p.add_argument("--e2e-targets", choices=["all", "qkvo"], default="all", help="modules the adapters adapt")
    p.add_argument("--tune-lora", action="store_true",
                   help="time the decode-shaped LoRA variants (per segment class) and launch sizes first and use "
                        "the fastest for the rest of the run")
    p.add_argument("--only-lora", action="store_true",
                   help="LoRA checks and timings only (no attention, MoE or host-miss sections)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="start no new end-to-end configuration after this many seconds of the run")
    return p.parse_args()


def main() -> int:
    args = _parse_args()
    if args.cpu_smoke:
        # read when a @triton.jit function is decorated: before loraplex's kernel modules load
        os.environ["TRITON_INTERPRET"] = "1"
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here.parent)]  # the lab modules beside us; loraplex from the repo

    import torch
    import triton
    from bench_kernels import (
        bench_attention,
        bench_graph_metadata,
        bench_lora,
        bench_vocab_lora,
        measure_copy_bandwidth,
    )
    from check_kernels import run_checks
    from moe_fp8_lab import bench_moe_fp8
    from moe_lab import bench_moe
    from moe_lora_lab import bench_moe_lora
    from sampler_lab import bench_sampler
    from lab_common import Report, run_section

    on_gpu = torch.cuda.is_available() and not args.cpu_smoke
    if not on_gpu and not args.cpu_smoke:
        print("no CUDA device: run on the GPU machine, or pass --cpu-smoke", file=sys.stderr)
        return 2
    device = "cuda" if on_gpu else "cpu"
    card = torch.cuda.get_device_name(0) if on_gpu else f"CPU ({platform.processor() or platform.machine()}), interpreter"
    report = Report("loraplex kernel check" + (" (CPU smoke: no GPU figures)" if not on_gpu else ""))
    report.line(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; card: {card}")
    report.line(f"torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}")
    report.line()
    start = time.time()

    if args.tune_lora:
        from tune_lora import tune_decode_lora

        from loraplex.kernels import triton_lora

        # installed for the rest of this process: the checks, timings and engine below use it
        triton_lora.DEFAULT_TUNING = tune_decode_lora(report, on_gpu, device)
        report.line(f"(tuning done at {time.time() - start:.0f} s)")
        report.write()
    run_section(report, "correctness section", run_checks, report, on_gpu, args.only_lora)
    report.line(f"(correctness done at {time.time() - start:.0f} s)")
    report.line()
    report.write()  # after each section, so a run cut short still leaves its results
    if not args.skip_bench:
        copy_bw = measure_copy_bandwidth(report, on_gpu, device)
        run_section(report, "LoRA timings section", bench_lora, report, on_gpu, device, copy_bw)
        run_section(report, "LoRA graph-metadata timings section", bench_graph_metadata, report, on_gpu, device)
        run_section(report, "vocabulary LoRA timings section", bench_vocab_lora, report, on_gpu, device, copy_bw)
        if not args.only_lora:
            run_section(report, "attention timings section", bench_attention, report, on_gpu, device, copy_bw)
            run_section(report, "MoE timings section", bench_moe, report, on_gpu, device, copy_bw)
            run_section(report, "MoE LoRA timings section", bench_moe_lora, report, on_gpu, device)
            run_section(report, "MoE fp8 timings section", bench_moe_fp8, report, on_gpu, device, copy_bw)
            run_section(report, "sampler timings section", bench_sampler, report, on_gpu, device)
        report.line(f"(timings done at {time.time() - start:.0f} s)")
        report.line()
        report.write()
    if not args.skip_e2e:
        def end_to_end() -> None:
            # the engine is another team's moving part: a failure here keeps the kernel results
            from e2e_bench import run_e2e

            run_e2e(
                report, on_gpu, layers=args.e2e_layers, max_tokens=args.e2e_max_tokens,
                prompt_len=args.e2e_prompt_len, targets=args.e2e_targets, deadline=start + args.budget_s,
                host_miss=not args.only_lora,
            )

        run_section(report, "end-to-end run", end_to_end)
        report.line(f"(end to end done at {time.time() - start:.0f} s)")

    report.line()
    report.line("## Targets")
    for t in report.targets:
        report.line(f"- {t}")
    if report.failures:
        report.line(f"FAILURES ({len(report.failures)}):")
        for f in report.failures:
            report.line(f"- {f}")
    path = report.write()
    if path:
        print(f"wrote {path}")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
