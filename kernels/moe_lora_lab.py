"""Expert LoRA part of the GPU check (``loraplex/kernels/triton_moe_lora.py`` inside the fused MoE):
bf16 against the fp32 torch path with the same LoRA, a CUDA-graph replay with a new routing and
new token slots, and timings of the fused experts with and without expert LoRA.

Shapes: Qwen3-30B-A3B's sparse layer (E=128, top-8, H=2048, I=768) with 4 slots of rank 16 on the
GPU; tiny ones under the interpreter. Token slots cycle through the slots and base-only (-1).
"""

from __future__ import annotations

import torch
from lab_common import Report, bench_ms, rel_err
from moe_lab import _experts, _routing, _shape, _token_counts

from loraplex.kernels.moe_lora import ExpertLoRA
from loraplex.kernels.moe_torch import run_experts
from loraplex.kernels.triton_moe import fused_moe_triton

TOLERANCE = 1e-2  # bf16 operands against an fp32 reference
SLOTS = 4


def _lora(gen, tokens: int, experts: int, hidden: int, inter: int, rank: int, dtype, device) -> ExpertLoRA:
    def rand(*shape, scale):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    slots = torch.tensor([((t + 1) % (SLOTS + 1)) - 1 for t in range(tokens)], dtype=torch.int64, device=device)
    return ExpertLoRA(
        slots,
        rand(2, SLOTS, experts, rank, hidden, scale=hidden**-0.5),
        rand(SLOTS, experts, 2 * inter, rank, scale=rank**-0.5),
        torch.full((2, SLOTS, experts), 0.5, device=device),
        rand(SLOTS, experts, rank, inter, scale=inter**-0.5), rand(SLOTS, experts, hidden, rank, scale=rank**-0.5),
        torch.full((SLOTS, experts), 0.5, device=device),
    )


def _as_fp32(lora: ExpertLoRA) -> ExpertLoRA:
    return ExpertLoRA(lora.token_slot, *(t.float() for t in (lora.a_gate_up, lora.b_gate_up, lora.scaling_gate_up,
                                                               lora.a_down, lora.b_down, lora.scaling_down)))


def check_moe_lora(report: Report, on_gpu: bool, gen: torch.Generator, dtype: torch.dtype, device: str) -> None:
    """Each token count against the fp32 torch path (same rounded inputs); on the GPU one launch
    with expert LoRA captured in a CUDA graph and replayed with a new routing and new slots."""
    e, k, h, i = _shape(on_gpu)
    rank = 16 if on_gpu else 3
    gate_up, down = _experts(gen, e, h, i, dtype, device)
    for tokens in _token_counts(on_gpu):
        x, weights, ids = _routing(gen, tokens, e, k, h, dtype, device, False)
        lora = _lora(gen, tokens, e, h, i, rank, dtype, device)
        got = fused_moe_triton(x, weights, ids, gate_up, down, lora=lora)
        ref = run_experts(x.float(), weights.float(), ids, gate_up.float(), down.float(), _as_fp32(lora))
        base = run_experts(x.float(), weights.float(), ids, gate_up.float(), down.float())
        err, delta = rel_err(got, ref), rel_err(ref, base)
        ok = err < TOLERANCE and delta > 10 * TOLERANCE and not got.isnan().any().item()
        report.check(f"fused moe + expert LoRA T={tokens} {dtype}", ok,
                     f"rel err {err:.2e}; the LoRA moves the output by {delta:.2e} (E={e}, k={k}, r={rank})")
    if not on_gpu:
        return
    try:
        _check_graph_replay(report, gen, gate_up, down, rank, dtype, device)
    except Exception as exc:
        report.check("fused moe + expert LoRA CUDA graph replay", False, f"{type(exc).__name__}: {exc}")


def _check_graph_replay(report: Report, gen, gate_up, down, rank: int, dtype, device) -> None:
    e, i, h = gate_up.shape[0], down.shape[2], gate_up.shape[2]
    tokens, k = 64, 8
    x, weights, ids = _routing(gen, tokens, e, k, h, dtype, device, False)
    lora = _lora(gen, tokens, e, h, i, rank, dtype, device)
    fused_moe_triton(x, weights, ids, gate_up, down, lora=lora)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused_moe_triton(x, weights, ids, gate_up, down, lora=lora)
    x2, weights2, ids2 = _routing(gen, tokens, e, k, h, dtype, device, False)
    x.copy_(x2)
    weights.copy_(weights2)
    ids.copy_(ids2)
    lora.token_slot.copy_(lora.token_slot.flip(0))
    graph.replay()
    want = fused_moe_triton(x2, weights2, ids2, gate_up, down, lora=lora)
    same = bool(torch.equal(static_out, want))
    report.check("fused moe + expert LoRA CUDA graph replay, new routing and slots", same,
                 f"T={tokens}: replay bit-equal to an eager launch={same}")


def bench_moe_lora(report: Report, on_gpu: bool, device: str) -> None:
    dtype = torch.bfloat16 if on_gpu else torch.float16
    e, k, h, i = _shape(on_gpu)
    rank = 16 if on_gpu else 3
    gen = torch.Generator().manual_seed(1)
    gate_up, down = _experts(gen, e, h, i, dtype, device)
    report.line(f"## Fused MoE with expert LoRA ({dtype}, E={e}, top-{k}, H={h}, I={i}, {SLOTS} slots of rank {rank})")
    report.line()
    report.line("Per-pair LoRA deltas (each (token, k) pair reads its slot's A and B of its expert); tokens cycle "
                "through base-only and the slots. do_bench median, L2 flushed.")
    report.line()
    rows = []
    for tokens in _token_counts(on_gpu):
        x, weights, ids = _routing(gen, tokens, e, k, h, dtype, device, False)
        lora = _lora(gen, tokens, e, h, i, rank, dtype, device)
        ms_base = bench_ms(lambda: fused_moe_triton(x, weights, ids, gate_up, down), on_gpu)
        ms_lora = bench_ms(lambda: fused_moe_triton(x, weights, ids, gate_up, down, lora=lora), on_gpu)
        rows.append([tokens, f"{ms_base * 1e3:.1f}", f"{ms_lora * 1e3:.1f}", f"{ms_lora / ms_base:.2f}x"])
    report.table(["tokens", "fused us", "fused + expert LoRA us", "ratio"], rows)
