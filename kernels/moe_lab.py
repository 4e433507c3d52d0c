"""Fused MoE part of the GPU check (``loraplex/kernels/triton_moe.py``): correctness in low
precision against the fp32 torch path, a CUDA-graph replay with a new routing, and timings.

Shapes are Qwen3-30B-A3B's sparse layer on the GPU (E=128 experts, top-8, H=2048, I=768) and
tiny ones under the interpreter. Byte counts for the timings are the expert weights a step must
read: ``gate_up`` and ``down`` of each distinct expert the routing picks (x and the outputs are
under 1% of that at these sizes and are left out).
"""

from __future__ import annotations

import torch
from lab_common import Report, bench_ms, rel_err

from loraplex.kernels.moe_torch import run_experts
from loraplex.kernels.triton_moe import fused_moe_triton, moe_tiles

TOLERANCE = 1e-2  # bf16 operands against an fp32 reference


def _shape(on_gpu: bool) -> tuple[int, int, int, int]:
    """(experts, top_k, hidden, intermediate)."""
    return (128, 8, 2048, 768) if on_gpu else (8, 2, 32, 24)


def _token_counts(on_gpu: bool) -> list[int]:
    return [1, 64, 256] if on_gpu else [1, 5, 17]


def _experts(gen, experts, hidden, inter, dtype, device):
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(device=device, dtype=dtype)
    down = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(device=device, dtype=dtype)
    return gate_up, down


def _routing(gen, tokens, experts, top_k, hidden, dtype, device, fp32_weights: bool):
    """x and a routing from random router logits, top-k renormalised (Qwen3-MoE); the weights
    in the model dtype, or in fp32 as Mixtral hands them over."""
    x = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)
    probs = torch.softmax(torch.randn(tokens, experts, generator=gen) * 2, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights if fp32_weights else weights.to(dtype)
    return x, weights.to(device), ids.to(device)


def check_moe(report: Report, on_gpu: bool, gen: torch.Generator, dtype: torch.dtype, device: str) -> None:
    """Each token count against the fp32 torch path on the same (rounded) inputs; then, on the
    GPU, one launch captured in a CUDA graph and replayed after a new routing is copied into its
    inputs (the capture fails if the launch path syncs with the host)."""
    e, k, h, i = _shape(on_gpu)
    gate_up, down = _experts(gen, e, h, i, dtype, device)
    for tokens in _token_counts(on_gpu):
        for fp32_weights in (False, True):
            x, weights, ids = _routing(gen, tokens, e, k, h, dtype, device, fp32_weights)
            got = fused_moe_triton(x, weights, ids, gate_up, down)
            ref = run_experts(x.float(), weights.float(), ids, gate_up.float(), down.float())
            err = rel_err(got, ref)
            style = "fp32 (Mixtral)" if fp32_weights else f"{dtype} (Qwen)"
            block_m = moe_tiles(tokens * k, e, h, i)["BLOCK_M"]
            report.check(f"fused moe T={tokens} {style} weights", err < TOLERANCE and not got.isnan().any().item(),
                         f"rel err {err:.2e} (E={e}, k={k}, H={h}, I={i}, BLOCK_M={block_m})")
    if not on_gpu:
        return
    try:  # a launch path that syncs with the host raises inside the capture: report it as a failure
        _check_graph_replay(report, gen, gate_up, down, dtype, device)
    except Exception as exc:
        report.check("fused moe CUDA graph replay, new routing", False, f"{type(exc).__name__}: {exc}")


def _check_graph_replay(report: Report, gen, gate_up, down, dtype, device) -> None:
    e, h = gate_up.shape[0], gate_up.shape[2]
    tokens, k = 64, 8
    x, weights, ids = _routing(gen, tokens, e, k, h, dtype, device, False)
    fused_moe_triton(x, weights, ids, gate_up, down)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused_moe_triton(x, weights, ids, gate_up, down)
    x2, weights2, ids2 = _routing(gen, tokens, e, k, h, dtype, device, False)
    x.copy_(x2)
    weights.copy_(weights2)
    ids.copy_(ids2)
    graph.replay()
    want = fused_moe_triton(x2, weights2, ids2, gate_up, down)
    same = bool(torch.equal(static_out, want))
    report.check("fused moe CUDA graph replay, new routing", same,
                 f"T={tokens}: replay bit-equal to an eager launch={same}")


def bench_moe(report: Report, on_gpu: bool, device: str, copy_bw: float) -> None:
    dtype = torch.bfloat16 if on_gpu else torch.float16
    e, k, h, i = _shape(on_gpu)
    gen = torch.Generator().manual_seed(0)
    gate_up, down = _experts(gen, e, h, i, dtype, device)
    elt = gate_up.element_size()
    model = ": Qwen3-30B-A3B's sparse layer" if on_gpu else ""
    report.line(f"## Fused MoE ({dtype}, E={e}, top-{k}, H={h}, I={i}{model})")
    report.line()
    report.line("GB/s: gate_up + down of the distinct experts picked, per launch (do_bench median, L2 flushed); "
                "the torch path is the CPU path's loop run on the device (a host sync per call).")
    report.line()
    rows = []
    for tokens in _token_counts(on_gpu) + ([2048] if on_gpu else []):
        x, weights, ids = _routing(gen, tokens, e, k, h, dtype, device, False)
        picked = len(set(ids.flatten().tolist()))
        nbytes = picked * 3 * h * i * elt
        ms = bench_ms(lambda: fused_moe_triton(x, weights, ids, gate_up, down), on_gpu)
        ms_torch = bench_ms(lambda: run_experts(x, weights, ids, gate_up, down), on_gpu)
        gbs = nbytes / (ms * 1e-3)
        rows.append([tokens, picked, moe_tiles(tokens * k, e, h, i)["BLOCK_M"], f"{nbytes / 2**20:.0f}",
                     f"{ms * 1e3:.1f}", f"{gbs / 1e9:.0f}", f"{gbs / copy_bw * 100:.0f}%", f"{ms_torch * 1e3:.1f}"])
    report.table(["tokens", "experts read", "BLOCK_M", "MiB", "fused us", "GB/s", "of copy BW", "torch path us"], rows)
