"""LoRA on mixture-of-experts experts: what a step passes to ``dispatch.fused_moe`` and the torch
computation of the per-pair deltas (the CPU path and the oracle of ``triton_moe_lora``).

Each (token, k) pair whose token's adapter has expert LoRA adds, for its expert ``e`` and slot
``s``, the delta of slice ``j`` (gate, up; or down)::

    delta_j = scaling[j, s, e] * (inp @ A[j, s, e].T) @ B[s, e, rows_j].T     (fp32)

``inp`` is the token's hidden state for gate_up, the pair's SiLU(gate) * up for down. The
deltas are added to the expert's base output rounded to the model dtype, and the sum rounded
again: gate_up before SiLU(gate) * up, down before the routing weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExpertLoRA:
    """One sparse layer's expert LoRA for a step: the slot stacks (``lora.expert_slots``) and each
    token's slot (-1: no expert LoRA for that token)."""

    token_slot: torch.Tensor  # [T] int64
    a_gate_up: torch.Tensor  # [2, L, E, R, H]
    b_gate_up: torch.Tensor  # [L, E, 2I, R]
    scaling_gate_up: torch.Tensor  # [2, L, E] fp32
    a_down: torch.Tensor  # [L, E, R, I]
    b_down: torch.Tensor  # [L, E, H, R]
    scaling_down: torch.Tensor  # [L, E] fp32
    # [L] int32: each slot's expert rank; A rows and B columns past it are never read (a rank-8
    # adapter in a rank-64 pool reads an eighth); None: the stacks' R
    slot_rank: torch.Tensor | None = None

    def gate_up(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.a_gate_up, self.b_gate_up, self.scaling_gate_up

    def down(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.a_down.unsqueeze(0), self.b_down, self.scaling_down.unsqueeze(0)


def pair_deltas(
    inp: torch.Tensor,  # [N, in] one row per pair
    slots: torch.Tensor,  # [N] int64, >= 0
    expert: int,
    a: torch.Tensor,  # [S, L, E, R, in]
    b: torch.Tensor,  # [L, E, S * out_s, R]
    scaling: torch.Tensor,  # [S, L, E] fp32
    slot_rank: torch.Tensor | None = None,  # [L] int32; None = R
) -> torch.Tensor:  # [N, S * out_s] fp32
    """The deltas of ``N`` pairs of one ``expert`` (module doc), one matmul pair per slot."""
    num_slices = a.shape[0]
    out_s = b.shape[2] // num_slices
    out = torch.zeros(inp.shape[0], b.shape[2], dtype=torch.float32, device=inp.device)
    x32 = inp.float()
    for slot in slots.unique().tolist():
        rows = (slots == slot).nonzero().squeeze(1)
        r = a.shape[3] if slot_rank is None else int(slot_rank[slot])
        for j in range(num_slices):
            shrunk = (x32[rows] @ a[j, slot, expert, :r].float().T) * scaling[j, slot, expert]  # [n, r]
            out[rows, j * out_s:(j + 1) * out_s] = shrunk @ b[slot, expert, j * out_s:(j + 1) * out_s, :r].float().T
    return out


def add_pair_deltas(
    y: torch.Tensor,  # [N, out] an expert's base output (model dtype); updated rows returned
    inp: torch.Tensor,  # [N, in]
    slots: torch.Tensor,  # [N] int64, -1 = none
    expert: int,
    stacks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # (a, b, scaling) as ``pair_deltas``
    slot_rank: torch.Tensor | None = None,  # [L] int32
) -> torch.Tensor:  # [N, out]
    """``y`` with each LoRA pair's delta added (fp32 sum, rounded once to ``y``'s dtype)."""
    rows = (slots >= 0).nonzero().squeeze(1)
    if rows.numel() == 0:
        return y
    delta = pair_deltas(inp[rows], slots[rows], expert, *stacks, slot_rank=slot_rank)
    y = y.clone()
    y[rows] = (y[rows].float() + delta).to(y.dtype)
    return y


def token_slots_from_meta(
    token_perm: torch.Tensor,  # [T] int64
    seg_starts: torch.Tensor,  # [G + 1] int32
    seg_slot: torch.Tensor,  # [G] int32
    slot_active: torch.Tensor,  # [L] int32: 1 where the slot's adapter has expert LoRA
) -> torch.Tensor:  # [T] int64
    """Each token's slot from the step's LoRA metadata (rows before ``seg_starts[0]`` and past the
    last segment are base-only), -1 where the slot's adapter has no expert LoRA. Device ops of
    fixed sizes only: no host sync, so a CUDA graph replays it with its metadata."""
    num_tokens = token_perm.shape[0]
    rows = torch.arange(num_tokens, device=token_perm.device, dtype=torch.int32)
    seg = torch.searchsorted(seg_starts, rows, right=True) - 1  # [T]: the segment of each permuted row
    in_seg = (seg >= 0) & (seg < seg_slot.shape[0])
    slot = seg_slot.long()[seg.clamp(0, max(seg_slot.shape[0] - 1, 0))] if seg_slot.numel() else seg.long()
    slot = torch.where(in_seg, slot, -1)
    if slot_active.numel():
        slot = torch.where(slot >= 0, torch.where(slot_active[slot.clamp(min=0)] > 0, slot, -1), -1)
    out = torch.empty(num_tokens, dtype=torch.int64, device=token_perm.device)
    out.scatter_(0, token_perm, slot)
    return out
