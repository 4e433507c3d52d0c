"""Launch sizes of the decode-shaped LoRA kernels, timed side by side (part of the GPU check).

Each candidate ``GemvTuning`` is timed on the decode batches of the LoRA bench (Llama-3-8B's
qkv, gate_up and down, rank 16), shrink and expand separately, each launch in a CUDA graph over
input sets spanning 3x the L2 (as ``bench_kernels.py``). The fastest shrink settings and the
fastest expand settings by total time are returned; ``gpu_check.py --tune-lora`` installs them for
the rest of its run (bench and end to end), so the figures after it are of the settings printed.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from bench_kernels import RANK, _graph_ms, _l2_bytes, lora_input_sets, lora_modules, shrink_results
from lab_common import Report, make_meta, spread_slots

from loraplex.kernels import triton_lora
from loraplex.kernels.triton_lora import GemvTuning, lora_expand_triton, lora_shrink_triton

# The H200 sweep of 2026-12-04 (call 3) tried more programs (2048 / 4096), larger register tiles
# (8192 elements) and 8 warps: each was slower than the defaults. This grid looks the other way
# (fewer programs, smaller tiles) with 4 warps.
SHRINK_GRID = dict(shrink_programs=[256, 384, 512, 1024], shrink_tile_elements=[2048, 4096], shrink_num_warps=[4])
EXPAND_GRID = dict(expand_programs=[512, 1024, 2048], expand_tile_elements=[2048, 4096], expand_num_warps=[4])


def _candidates(grid: dict[str, list[int]], base: GemvTuning) -> list[GemvTuning]:
    names = list(grid)
    return [dataclasses.replace(base, **dict(zip(names, values))) for values in itertools.product(*grid.values())]


def tune_decode_lora(report: Report, on_gpu: bool, device: str) -> GemvTuning:
    dtype = torch.bfloat16 if on_gpu else torch.float16
    configs = [(64, 16), (64, 64), (256, 64), (256, 128)] if on_gpu else [(8, 2)]
    modules = {k: v for k, v in lora_modules(on_gpu).items() if k != "o"}
    l2 = _l2_bytes(on_gpu)
    base = triton_lora.DEFAULT_TUNING
    shrink_cands = _candidates(SHRINK_GRID, base)
    expand_cands = _candidates(EXPAND_GRID, base)
    shrink_us = [0.0] * len(shrink_cands)
    expand_us = [0.0] * len(expand_cands)
    for tokens, adapters in configs:
        meta = make_meta(spread_slots(tokens, adapters), [RANK] * adapters, device)
        for in_f, widths in modules.values():
            sets, scaling, offsets = lora_input_sets(tokens, adapters, in_f, widths, dtype, device, l2)
            n_sets = len(sets)
            shrunk_sets = shrink_results(sets, meta)  # what the expand candidates read
            for i, cand in enumerate(shrink_cands):
                def shrink_all(c=cand):
                    for x, a, _, _, scratch in sets:
                        lora_shrink_triton(x, a, meta, scratch, tuning=c)
                shrink_us[i] += _graph_ms(shrink_all, on_gpu, n_sets) * 1e3
            for i, cand in enumerate(expand_cands):
                def expand_all(c=cand):
                    for (_, _, b, y, _), shrunk in zip(sets, shrunk_sets):
                        lora_expand_triton(shrunk, b, scaling, offsets, meta, y, tuning=c)
                expand_us[i] += _graph_ms(expand_all, on_gpu, n_sets) * 1e3
            del sets, shrunk_sets
    report.line(f"## Decode-shaped LoRA launch sizes ({dtype}, rank {RANK}; us summed over T x adapters "
                f"{configs} and qkv, gate_up, down; the default marked)")
    report.line()
    rows = []
    for cands, times, grid in ((shrink_cands, shrink_us, SHRINK_GRID), (expand_cands, expand_us, EXPAND_GRID)):
        for cand, t in zip(cands, times):
            setting = ", ".join(f"{k}={getattr(cand, k)}" for k in grid)
            mark = " (default)" if all(getattr(cand, k) == getattr(base, k) for k in grid) else ""
            rows.append([setting + mark, f"{t:.1f}"])
    report.table(["setting", "total us"], rows)
    best_shrink = shrink_cands[min(range(len(shrink_cands)), key=shrink_us.__getitem__)]
    best_expand = expand_cands[min(range(len(expand_cands)), key=expand_us.__getitem__)]
    chosen = dataclasses.replace(best_shrink, **{k: getattr(best_expand, k) for k in EXPAND_GRID})
    report.line(f"chosen: {chosen}")
    report.line()
    return chosen
