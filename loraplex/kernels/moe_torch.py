"""Mixture-of-experts experts in plain torch: the CPU path of ``dispatch.fused_moe`` and the test
oracle of the fused Triton kernels (``triton_moe``); plus ``align_pairs``, the device-side
grouping of (token, expert) pairs into per-expert row blocks that the Triton kernels read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex.kernels.moe_lora import ExpertLoRA, add_pair_deltas


@dataclass(frozen=True)
class ExpertScales:
    """The fp32 scales of fp8 stacked experts (W8A16: ``weight * scale`` in the compute dtype), in
    the dense fp8 path's per-row layout (``model/fp8_weights``) with the expert dimension first."""

    gate_up: torch.Tensor  # [E, 2 * I, groups] fp32
    down: torch.Tensor  # [E, H, groups] fp32
    block_cols: int | None  # input columns one scale covers; None: groups == 1 (per tensor / channel)

    def dequantize(self, gate_up: torch.Tensor, down: torch.Tensor, expert: int, dtype: torch.dtype):
        """Expert ``expert``'s ``(gate_up [2I, H], down [H, I])`` in ``dtype``."""
        from loraplex.model.fp8_weights import dequantize  # the model layer's; imported late (layering)

        return (dequantize(gate_up[expert], self.gate_up[expert], dtype, self.block_cols),
                dequantize(down[expert], self.down[expert], dtype, self.block_cols))


def run_experts(
    x: torch.Tensor,  # [T, H]
    weights: torch.Tensor,  # [T, k] routing weights
    experts: torch.Tensor,  # [T, k] int64 expert ids
    gate_up: torch.Tensor,  # [E, 2 * I, H]
    down: torch.Tensor,  # [E, H, I]
    lora: ExpertLoRA | None = None,
    scales: ExpertScales | None = None,  # fp8 experts: each one run is dequantized to x's dtype first
) -> torch.Tensor:  # [T, H]
    """The weighted sum of each token's experts' SwiGLU outputs: tokens sorted by expert, one
    pair of matmuls per expert that got any, ``index_add`` back (the counts sync with the host).
    ``lora``: each pair's expert LoRA delta (``moe_lora``) is added to gate_up before the SiLU and
    to down before the routing weight."""
    num_experts, top_k = gate_up.shape[0], experts.shape[1]
    flat_experts = experts.reshape(-1)  # [T * k]
    order = torch.argsort(flat_experts, stable=True)  # pair indices grouped by expert
    counts = torch.bincount(flat_experts, minlength=num_experts).tolist()
    flat_weights = weights.reshape(-1)
    # the k weighted outputs of a token are summed in fp32 and rounded once, as transformers 5's
    # default (grouped_mm) experts path does (an index_add in bf16 would round after each add)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k  # [count]
        rows = x[tokens]  # [count, H]
        w_gate_up, w_down = (gate_up[expert], down[expert]) if scales is None else \
            scales.dequantize(gate_up, down, expert, x.dtype)
        gu = F.linear(rows, w_gate_up)  # [count, 2I]
        slots = None if lora is None else lora.token_slot[tokens]  # [count]
        if slots is not None:
            gu = add_pair_deltas(gu, rows, slots, expert, lora.gate_up(), lora.slot_rank)
        gate, up = gu.chunk(2, dim=-1)  # [count, I] each
        act = F.silu(gate) * up
        y = F.linear(act, w_down)  # [count, H]
        if slots is not None:
            y = add_pair_deltas(y, act, slots, expert, lora.down(), lora.slot_rank)
        y = y * flat_weights[pairs, None]  # fp32 with Mixtral's fp32 weights, else the model dtype
        out.index_add_(0, tokens, y.float())
    return out.to(x.dtype)


@dataclass
class PairBlocks:
    """The (token, expert) pairs of a step grouped into row blocks of ``block_m``, each block
    holding pairs of one expert, every expert's pairs padded to a multiple of ``block_m``.

    Pair ``p`` is token ``p // k``'s ``p % k``-th choice. Every size is a bound computed from
    host ints (``num_pairs``, ``num_experts``, ``block_m``), never from the routing, so building
    these reads nothing back to the host and a CUDA graph can replay it."""

    sorted_pair_ids: torch.Tensor  # [max_blocks * block_m] int64; num_pairs marks a padding row
    block_expert: torch.Tensor  # [max_blocks] int64; -1 for a block past the last expert's pairs
    num_padded: torch.Tensor  # [1] int64: rows in use (a multiple of block_m)
    num_pairs: int
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]


def max_pair_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most blocks ``num_pairs`` pairs can fill: an expert with ``c`` pairs takes
    ``ceil(c / block_m) <= c // block_m + 1`` blocks, and at most ``min(num_pairs, num_experts)``
    experts get any (tighter than ``num_pairs + num_experts * (block_m - 1)`` rows)."""
    return num_pairs // block_m + min(num_pairs, num_experts)


def align_pairs(
    experts: torch.Tensor,  # [T, k] int64 expert ids
    num_experts: int,
    block_m: int,
) -> PairBlocks:
    """Group the pairs by expert (stable: within an expert, in token order) into padded blocks,
    with torch ops whose output sizes do not depend on the ids (no ``bincount``, which sizes its
    output by the largest id, nor boolean indexing)."""
    flat = experts.reshape(-1)  # [P]
    num_pairs = flat.shape[0]
    max_blocks = max_pair_blocks(num_pairs, num_experts, block_m)
    device = flat.device
    sorted_experts, order = torch.sort(flat, stable=True)  # [P] each
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts  # [E]: first sorted position of each expert
    rank = torch.arange(num_pairs, device=device) - start[sorted_experts]  # [P]: place within its expert
    dest = padded_start[sorted_experts] + rank  # [P]
    sorted_pair_ids = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int64, device=device)
    sorted_pair_ids.scatter_(0, dest, order)
    block_row = torch.arange(max_blocks, device=device, dtype=torch.int64) * block_m  # [B]
    block_expert = torch.searchsorted(padded_end, block_row, right=True)  # == E past the last block
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return PairBlocks(sorted_pair_ids, block_expert, padded_end[-1:].clone(), num_pairs, block_m)
