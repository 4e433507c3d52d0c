"""FP8 experts part of the GPU check (``triton_moe``'s ``W_FP8``: W8A16 fused MoE): bf16 compute with
fp8 experts against the fp32 torch path on the same experts dequantized first, per 128x128 block
(Qwen3-30B-A3B-FP8) and per output channel (llm-compressor FP8-dynamic), also with the weights
read as bytes (the path of GPUs before sm_89, forced), a CUDA-graph replay with a new routing, and timings of the fp8 experts against the same experts in bf16.

Shapes: Qwen3-30B-A3B's sparse layer on the GPU (E=128, top-8, H=2048, I=768), tiny ones under
the interpreter (16x16 blocks there). GB/s counts the weight bytes a launch reads: gate_up and
down of each distinct expert picked (1 byte per element for fp8, plus its scales).
"""

from __future__ import annotations

import torch
from lab_common import Report, bench_ms, rel_err
from moe_lab import _experts, _routing, _shape, _token_counts

from loraplex.kernels.moe_torch import ExpertScales, run_experts
from loraplex.kernels.triton_moe import fused_moe_triton
from loraplex.model.fp8_weights import FP8_DTYPE, FP8_MAX, dequantize, quantize_per_channel

TOLERANCE = 1e-2  # bf16 activations against an fp32 reference on the same fp8 weights


def quantize_blocks(w: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [E, out, in] in fp8 with one scale per ``rows x cols`` block, the scales in the per-row
    layout ``[E, out, ceil(in / cols)]`` the kernels read."""
    e, out, inp = w.shape
    nr, nc = -(-out // rows), -(-inp // cols)
    padded = torch.zeros(e, nr * rows, nc * cols, device=w.device)
    padded[:, :out, :inp] = w.float().abs()
    scale = (padded.view(e, nr, rows, nc, cols).amax(dim=(2, 4)) / FP8_MAX).clamp_min(1e-12)  # [E, nr, nc]
    per_row = scale.repeat_interleave(rows, dim=1)[:, :out].contiguous()
    full = per_row.repeat_interleave(cols, dim=2)[:, :, :inp]
    return (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), per_row


def fp8_experts(gate_up: torch.Tensor, down: torch.Tensor, block: int | None):
    """``(gate_up fp8, down fp8, ExpertScales)``: per block of ``block`` x ``block``, else per row."""
    if block is None:
        gu, dn = quantize_per_channel(gate_up), quantize_per_channel(down)
        return gu.weight, dn.weight, ExpertScales(gu.scale, dn.scale, None)
    (gu, gu_s), (dn, dn_s) = quantize_blocks(gate_up, block, block), quantize_blocks(down, block, block)
    return gu, dn, ExpertScales(gu_s, dn_s, block)


def _dequantized(gu, dn, scales: ExpertScales):  # fp32 [E, 2I, H], [E, H, I]
    return (dequantize(gu, scales.gate_up, torch.float32, scales.block_cols),
            dequantize(dn, scales.down, torch.float32, scales.block_cols))


def check_moe_fp8(report: Report, on_gpu: bool, gen: torch.Generator, dtype: torch.dtype, device: str) -> None:
    e, k, h, i = _shape(on_gpu)
    gate_up, down = _experts(gen, e, h, i, torch.float32, device)
    for block in (128 if on_gpu else 16, None):
        gu, dn, scales = fp8_experts(gate_up, down, block)
        gu32, dn32 = _dequantized(gu, dn, scales)
        label = f"{block}x{block} blocks" if block else "per-channel"
        for tokens in _token_counts(on_gpu):
            x, weights, ids = _routing(gen, tokens, e, k, h, dtype, device, False)
            got = fused_moe_triton(x, weights, ids, gu, dn, scales=scales)
            ref = run_experts(x.float(), weights.float(), ids, gu32, dn32)
            err = rel_err(got, ref)
            report.check(f"fused moe fp8 experts ({label}) T={tokens} {dtype}",
                         err < TOLERANCE and not got.isnan().any().item(),
                         f"rel err {err:.2e} against fp32 on the dequantized experts (E={e}, k={k}, H={h}, I={i})")
        # the byte decoding GPUs before sm_89 run (forced here: it must compile and agree on any GPU)
        x, weights, ids = _routing(gen, _token_counts(on_gpu)[1], e, k, h, dtype, device, False)
        got = fused_moe_triton(x, weights, ids, gu, dn, scales=scales, fp8_as_bits=True)
        err = rel_err(got, run_experts(x.float(), weights.float(), ids, gu32, dn32))
        report.check(f"fused moe fp8 experts ({label}) read as bytes T={x.shape[0]} {dtype}",
                     err < TOLERANCE and not got.isnan().any().item(), f"rel err {err:.2e} (the pre-sm_89 path)")
        if on_gpu:
            try:
                _check_graph_replay(report, gen, gu, dn, scales, label, dtype, device)
            except Exception as exc:
                report.check(f"fused moe fp8 experts ({label}) CUDA graph replay", False,
                             f"{type(exc).__name__}: {exc}")


def _check_graph_replay(report: Report, gen, gu, dn, scales, label: str, dtype, device) -> None:
    e, h = gu.shape[0], gu.shape[2]
    tokens, k = 64, 8
    x, weights, ids = _routing(gen, tokens, e, k, h, dtype, device, False)
    fused_moe_triton(x, weights, ids, gu, dn, scales=scales)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused_moe_triton(x, weights, ids, gu, dn, scales=scales)
    x2, weights2, ids2 = _routing(gen, tokens, e, k, h, dtype, device, False)
    x.copy_(x2)
    weights.copy_(weights2)
    ids.copy_(ids2)
    graph.replay()
    same = bool(torch.equal(static_out, fused_moe_triton(x2, weights2, ids2, gu, dn, scales=scales)))
    report.check(f"fused moe fp8 experts ({label}) CUDA graph replay, new routing", same,
                 f"T={tokens}: replay bit-equal to an eager launch={same}")


def bench_moe_fp8(report: Report, on_gpu: bool, device: str, copy_bw: float) -> None:
    dtype = torch.bfloat16 if on_gpu else torch.float16
    e, k, h, i = _shape(on_gpu)
    block = 128 if on_gpu else 16
    gen = torch.Generator().manual_seed(2)
    gate_up, down = _experts(gen, e, h, i, dtype, device)
    gu, dn, scales = fp8_experts(gate_up, down, block)
    report.line(f"## Fused MoE, fp8 experts ({block}x{block} block scales, {dtype} activations) against "
                f"{dtype} experts (E={e}, top-{k}, H={h}, I={i})")
    report.line()
    report.line("GB/s: gate_up + down (+ scales) of the distinct experts picked, per launch (do_bench median, "
                "L2 flushed).")
    report.line()
    rows = []
    scale_bytes = (scales.gate_up[0].numel() + scales.down[0].numel()) * 4
    for tokens in _token_counts(on_gpu) + ([2048] if on_gpu else []):
        x, weights, ids = _routing(gen, tokens, e, k, h, dtype, device, False)
        picked = len(set(ids.flatten().tolist()))
        fp8_bytes = picked * (3 * h * i + scale_bytes)
        ms16 = bench_ms(lambda: fused_moe_triton(x, weights, ids, gate_up, down), on_gpu)
        ms8 = bench_ms(lambda: fused_moe_triton(x, weights, ids, gu, dn, scales=scales), on_gpu)
        gbs = fp8_bytes / (ms8 * 1e-3)
        rows.append([tokens, picked, f"{ms16 * 1e3:.1f}", f"{ms8 * 1e3:.1f}", f"{ms16 / ms8:.2f}x",
                     f"{gbs / 1e9:.0f}", f"{gbs / copy_bw * 100:.0f}%"])
    report.table(["tokens", "experts read", f"{dtype} experts us", "fp8 experts us", "speed-up", "fp8 GB/s",
                  "of copy BW"], rows)
