"""The decode-shaped LoRA kernels' variants and launch sizes, timed side by side (part of the GPU
check).

First the variants (``SHRINK_VARIANTS`` / ``EXPAND_VARIANTS`` that might win: the H200 call of
2026-12-04 found "reduce" and "plain" slower everywhere) at the launch sizes in use, per segment
class: the fastest whose output matches the variant in use is chosen for that class (a class no
case covers keeps its variant). Then each candidate ``GemvTuning`` of the launch-size grid, with
those variants. Everything is timed on the decode batches of the LoRA bench (Llama-3-8B's qkv,
gate_up and down, rank 16), shrink and expand separately, each launch in a CUDA graph over input
sets spanning 3x the L2 (as ``bench_kernels.py``). ``gpu_check.py --tune-lora`` installs the
result for the rest of its run (bench and end to end), so the figures after it are of the
settings printed.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from bench_kernels import (
    RANK,
    _graph_ms,
    _l2_bytes,
    expand_variant_us,
    lora_input_sets,
    lora_modules,
    shrink_results,
    shrink_variant_us,
)
from lab_common import Report, make_meta, spread_slots

from loraplex.kernels import triton_lora
from loraplex.kernels.triton_lora import (
    DECODE_SEG_CLASSES,
    SPLIT_SUMS,
    GemvTuning,
    decode_seg_class_index,
    lora_expand_triton,
    lora_shrink_triton,
)

# The H200 sweep of 2026-12-04 (call 3) tried more programs (2048 / 4096), larger register tiles
# (8192 elements) and 8 warps: each was slower than the defaults. This grid looks the other way
# (fewer programs, smaller tiles) with 4 warps.
SHRINK_GRID = dict(shrink_programs=[256, 384, 512, 1024], shrink_tile_elements=[2048, 4096], shrink_num_warps=[4])
EXPAND_GRID = dict(expand_programs=[512, 1024, 2048], expand_tile_elements=[2048, 4096], expand_num_warps=[4])
# The decode "dot" shrink's elements of x and A per pipeline stage (its K tile: 128 to 1024 at
# rank 16) and stages in flight (call 4 ran 8192 and 3). Compiled for sm_90 (Triton 3.6) each
# holds 40-120 registers, no spills, 8-192 KB of shared memory (sm_90: 227 KB); a setting that
# fails to launch anyway is reported as failed, not chosen.
DOT_GRID = dict(shrink_dot_stage_elements=[4096, 8192, 16384, 32768], shrink_dot_num_stages=[2, 3, 4])
SHRINK_CANDIDATES = ("rows_x_rank", "acc", "dot")
EXPAND_CANDIDATES = ("rows", "tiled", "dot", "rows_ahead")


def _candidates(grid: dict[str, list[int]], base: GemvTuning) -> list[GemvTuning]:
    names = list(grid)
    return [dataclasses.replace(base, **dict(zip(names, values))) for values in itertools.product(*grid.values())]


def _setting_rows(cands: list[GemvTuning], cells: list[str], grid: dict, base: GemvTuning) -> list[list[str]]:
    """A table row per candidate: its ``grid`` settings (those of ``base`` marked) and its cell."""
    rows = []
    for cand, cell in zip(cands, cells):
        setting = ", ".join(f"{k}={getattr(cand, k)}" for k in grid)
        mark = " (default)" if all(getattr(cand, k) == getattr(base, k) for k in grid) else ""
        rows.append([setting + mark, cell])
    return rows


def _cases(on_gpu: bool, device: str):
    """Each (tokens, adapters, module, metadata, input sets, scaling, slice offsets) the tuning
    times, made one at a time (the sets of one case span 3x the L2)."""
    dtype = torch.bfloat16 if on_gpu else torch.float16
    configs = [(64, 16), (64, 64), (256, 64), (256, 128)] if on_gpu else [(8, 2), (8, 8)]
    modules = {k: v for k, v in lora_modules(on_gpu).items() if k != "o"}
    l2 = _l2_bytes(on_gpu)
    for tokens, adapters in configs:
        meta = make_meta(spread_slots(tokens, adapters), [RANK] * adapters, device)
        for mod, (in_f, widths) in modules.items():
            sets, scaling, offsets = lora_input_sets(tokens, adapters, in_f, widths, dtype, device, l2)
            yield tokens, adapters, mod, meta, sets, scaling, offsets
            del sets


def choose_variants(report: Report, on_gpu: bool, device: str, base: GemvTuning) -> GemvTuning:
    """``base`` with, for each segment class the cases cover, the fastest correct variant of
    shrink and of expand (summed over the class's cases)."""
    totals: dict[tuple[str, int, str], float] = {}  # (kernel, class index, variant) -> us; absent = failed
    wrong: set[tuple[str, int, str]] = set()
    cells = []
    for tokens, adapters, mod, meta, sets, scaling, offsets in _cases(on_gpu, device):
        c = decode_seg_class_index(meta.max_seg_len)
        shrunk_sets = shrink_results(sets, meta)  # by the shrink in use: what each expand reads
        row = [tokens, adapters, mod, DECODE_SEG_CLASSES[c]]
        for kernel, variants, timing in (
            ("shrink", SHRINK_CANDIDATES, lambda g: shrink_variant_us(sets, meta, g, on_gpu)),
            ("expand", EXPAND_CANDIDATES, lambda g: expand_variant_us(sets, shrunk_sets, scaling, offsets, meta, g,
                                                                      on_gpu)),
        ):
            for gemv in variants:
                us, cell = timing(gemv)
                key = (kernel, c, gemv)
                if us is None:
                    wrong.add(key)
                else:
                    totals[key] = totals.get(key, 0.0) + us
                row.append(cell)
        cells.append(row)
        del shrunk_sets
    report.line("## Decode-shaped LoRA variants (us per launch, same inputs; the fastest correct one per segment "
                "class is used from here on)")
    report.line()
    report.table(["tokens", "adapters", "module", "segment class"] + [f"shrink {g}" for g in SHRINK_CANDIDATES]
                 + [f"expand {g}" for g in EXPAND_CANDIDATES], cells)
    chosen = {"shrink": list(base.shrink_gemv), "expand": list(base.expand_gemv)}
    for kernel, variants in (("shrink", SHRINK_CANDIDATES), ("expand", EXPAND_CANDIDATES)):
        for c in {key[1] for key in totals if key[0] == kernel}:
            timed = {g: totals[(kernel, c, g)] for g in variants
                     if (kernel, c, g) in totals and (kernel, c, g) not in wrong}
            if timed:
                chosen[kernel][c] = min(timed, key=timed.__getitem__)
    tuned = dataclasses.replace(base, shrink_gemv=tuple(chosen["shrink"]), expand_gemv=tuple(chosen["expand"]))
    report.line(f"variants per segment class {DECODE_SEG_CLASSES}: shrink {tuned.shrink_gemv}, "
                f"expand {tuned.expand_gemv} (were {base.shrink_gemv}, {base.expand_gemv})")
    report.line()
    return tuned


def tune_decode_lora(report: Report, on_gpu: bool, device: str) -> GemvTuning:
    dtype = torch.bfloat16 if on_gpu else torch.float16
    base = choose_variants(report, on_gpu, device, triton_lora.DEFAULT_TUNING)
    shrink_cands = _candidates(SHRINK_GRID, base)
    expand_cands = _candidates(EXPAND_GRID, base)
    shrink_us = [0.0] * len(shrink_cands)
    expand_us = [0.0] * len(expand_cands)
    configs = []
    for tokens, adapters, _, meta, sets, scaling, offsets in _cases(on_gpu, device):
        if (tokens, adapters) not in configs:
            configs.append((tokens, adapters))
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
        del shrunk_sets
    report.line(f"## Decode-shaped LoRA launch sizes ({dtype}, rank {RANK}, the variants chosen above; us summed "
                f"over T x adapters {configs} and qkv, gate_up, down; the sizes in use before marked (default))")
    report.line()
    rows = []
    for cands, times, grid in ((shrink_cands, shrink_us, SHRINK_GRID), (expand_cands, expand_us, EXPAND_GRID)):
        rows += _setting_rows(cands, [f"{t:.1f}" for t in times], grid, base)
    report.table(["setting", "total us"], rows)
    best_shrink = shrink_cands[min(range(len(shrink_cands)), key=shrink_us.__getitem__)]
    best_expand = expand_cands[min(range(len(expand_cands)), key=expand_us.__getitem__)]
    chosen = dataclasses.replace(best_shrink, **{k: getattr(best_expand, k) for k in EXPAND_GRID})
    if "dot" in chosen.shrink_gemv:
        chosen = choose_dot_stages(report, on_gpu, device, chosen)
    chosen = choose_split_sum(report, on_gpu, device, chosen)
    report.line(f"chosen: {chosen}")
    report.line()
    return chosen


def choose_dot_stages(report: Report, on_gpu: bool, device: str, base: GemvTuning) -> GemvTuning:
    """``base`` with the fastest ``DOT_GRID`` setting of the "dot" shrink, timed on the cases
    whose segment class runs it; a setting that fails to launch or whose output strays from the
    one in use is out."""
    cands = _candidates(DOT_GRID, base)
    totals = [0.0] * len(cands)
    out: dict[int, str] = {}  # candidate -> its failed or WRONG cell
    for _, _, _, meta, sets, _, _ in _cases(on_gpu, device):
        if base.shrink_gemv_for(meta.max_seg_len) != "dot":
            continue
        for i, cand in enumerate(cands):
            if i not in out:
                us, cell = shrink_variant_us(sets, meta, "dot", on_gpu, tuning=cand)
                if us is None:
                    out[i] = cell
                else:
                    totals[i] += us
    report.line("## The dot shrink's pipeline (us summed over the cases it runs, the setting above)")
    report.line()
    cells = [out.get(i, f"{t:.1f}") for i, t in enumerate(totals)]
    report.table(["setting", "total us"], _setting_rows(cands, cells, DOT_GRID, base))
    usable = [i for i in range(len(cands)) if i not in out]
    if not usable:
        return base
    return cands[min(usable, key=totals.__getitem__)]


def choose_split_sum(report: Report, on_gpu: bool, device: str, base: GemvTuning) -> GemvTuning:
    """``base`` with the faster of ``SPLIT_SUMS`` on the tuning's cases: shrink and expand timed
    together (the choice moves work between them). Both must give the same bits (the same fp32
    additions in the same order); where they do not, the sum keeps its own launch."""
    totals = dict.fromkeys(SPLIT_SUMS, 0.0)
    rows, differ = [], []
    for tokens, adapters, mod, meta, sets, scaling, offsets in _cases(on_gpu, device):
        row = [tokens, adapters, mod]
        x0, a0, b0, y0, scratch0 = sets[0]
        fresh = torch.randn(y0.shape, device=y0.device).to(y0.dtype)  # not the timed y (see expand_variant_us)
        outs = {}
        for split_sum in SPLIT_SUMS:
            tuning = dataclasses.replace(base, split_sum=split_sum)

            def both_all(t=tuning):
                for x, a, b, y, scratch in sets:
                    shrunk = lora_shrink_triton(x, a, meta, scratch, tuning=t)
                    lora_expand_triton(shrunk, b, scaling, offsets, meta, y, tuning=t)

            us = _graph_ms(both_all, on_gpu, len(sets)) * 1e3
            totals[split_sum] += us
            row.append(f"{us:.1f}")
            outs[split_sum] = fresh.clone()
            lora_expand_triton(lora_shrink_triton(x0, a0, meta, scratch0, tuning=tuning), b0, scaling, offsets, meta,
                               outs[split_sum], tuning=tuning)
        if not torch.equal(*outs.values()):
            differ.append(f"{tokens}/{adapters} {mod}")
            row[-1] += " DIFFERS"
        rows.append(row)
    report.line("## Where the shrink's K-split partials are added (us per shrink + expand, the setting above)")
    report.line()
    report.table(["tokens", "adapters", "module"] + [f"summed by {s}" for s in SPLIT_SUMS], rows)
    best = "launch" if differ else min(totals, key=totals.__getitem__)
    report.line("totals: " + ", ".join(f"{s} {t:.1f} us" for s, t in totals.items()) + f"; chosen: {best}"
                + (f" (y differs between the two at {', '.join(differ)})" if differ else ""))
    report.line()
    if differ:
        report.failures.append("split partials summed in expand differ from the sum launch")
    return dataclasses.replace(base, split_sum=best)
