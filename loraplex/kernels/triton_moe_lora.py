"""LoRA on mixture-of-experts experts in Triton: the per-pair deltas ``triton_moe``'s kernels add
(``moe_lora`` has the math and the torch twin these are tested against).

Each (token, k) pair reads its own slot's A and B of its own expert, so the deltas are a
shrink and an expand per pair, not grouped GEMMs:

1. ``_pair_shrink_kernel``, one program per (pair, slice): ``u[p, j, :R] = scaling * inp[row(p)]
   @ A[j, slot, e].T`` in fp32 (``row(p)`` is ``p // k`` for gate_up's token rows, ``p`` for
   down's activation rows);
2. ``_pair_expand_kernel``, one program per (pair, slice, column tile): ``delta[p, cols_j] = u[p, j]
   @ B[slot, e, cols_j].T``, written in fp32; a pair without expert LoRA (slot -1) writes zeros,
   so the output needs no clearing.

A pair costs ``r * (in + out)`` weight reads (``r`` its slot's rank: rows and columns past it
are masked off, so a small adapter in a pool of large ``R`` reads only its own) whatever the
batch: fine for decode steps (a few pairs per expert and adapter), not tuned for long prefills. The grid is ``num_pairs`` (a host
int) by slices by tiles and the slots are read on the device, so these launches are captured in
a CUDA graph with the experts' kernels. Strides past the slot and expert are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.moe_lora import ExpertLoRA


@triton.jit
def _pair_shrink_kernel(
    inp_ptr,  # [rows, in]
    a_ptr,  # [S, L, E, R, in]
    scaling_ptr,  # [S, L, E] fp32
    u_ptr,  # [P, S, R] fp32
    pair_slot_ptr,  # [P] int64, -1 = none
    pair_expert_ptr,  # [P] int64
    slot_rank_ptr,  # [L] int32: rows of A past a slot's rank are not read
    row_div,  # pair p reads inp row p // row_div
    in_f,
    rank,
    stride_ir, stride_ik,
    stride_as, stride_al, stride_ae, stride_ar, stride_ak,
    stride_ss, stride_sl, stride_se,
    stride_up, stride_us, stride_ur,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    slot = tl.load(pair_slot_ptr + pair)
    if slot < 0:
        return
    expert = tl.load(pair_expert_ptr + pair)
    row = pair // row_div
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < tl.minimum(tl.load(slot_rank_ptr + slot), rank)
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + j * stride_as + slot * stride_al + expert * stride_ae + offs_r[:, None].to(tl.int64) * stride_ar
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, in_f, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < in_f
        x = tl.load(inp_ptr + row * stride_ir + k * stride_ik, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_rows + k[None, :] * stride_ak, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    scale = tl.load(scaling_ptr + j * stride_ss + slot * stride_sl + expert * stride_se)
    tl.store(u_ptr + pair * stride_up + j * stride_us + offs_r * stride_ur, acc * scale, mask=r_mask)


@triton.jit
def _pair_expand_kernel(
    u_ptr,  # [P, S, R] fp32
    b_ptr,  # [L, E, S * out_s, R]
    out_ptr,  # [P, S * out_s] fp32
    pair_slot_ptr,  # [P] int64
    pair_expert_ptr,  # [P] int64
    slot_rank_ptr,  # [L] int32: columns of B past a slot's rank are not read
    out_s,
    rank,
    stride_up, stride_us, stride_ur,
    stride_bl, stride_be, stride_bn, stride_br,
    stride_op, stride_on,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    n_tile = tl.program_id(2)
    slot = tl.load(pair_slot_ptr + pair)
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < out_s
    cols = j * out_s + offs_n  # columns of this slice in the stacked output
    out_ptrs = out_ptr + pair * stride_op + cols.to(tl.int64) * stride_on
    if slot < 0:
        tl.store(out_ptrs, tl.zeros((BLOCK_N,), dtype=tl.float32), mask=n_mask)
        return
    expert = tl.load(pair_expert_ptr + pair)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < tl.minimum(tl.load(slot_rank_ptr + slot), rank)
    u = tl.load(u_ptr + pair * stride_up + j * stride_us + offs_r * stride_ur, mask=r_mask, other=0.0)
    b_ptrs = (b_ptr + slot * stride_bl + expert * stride_be + cols[:, None].to(tl.int64) * stride_bn
              + offs_r[None, :] * stride_br)
    b = tl.load(b_ptrs, mask=n_mask[:, None] & r_mask[None, :], other=0.0)
    tl.store(out_ptrs, tl.sum(b.to(tl.float32) * u[None, :], axis=1), mask=n_mask)


def pair_lora_deltas(
    inp: torch.Tensor,  # [rows, in]
    row_div: int,  # pair p reads row p // row_div
    pair_slot: torch.Tensor,  # [P] int64, -1 = none
    pair_expert: torch.Tensor,  # [P] int64
    a: torch.Tensor,  # [S, L, E, R, in]
    b: torch.Tensor,  # [L, E, S * out_s, R]
    scaling: torch.Tensor,  # [S, L, E] fp32
    slot_rank: torch.Tensor | None = None,  # [L] int32; None = R
    out: torch.Tensor | None = None,  # [P, S * out_s] fp32, else allocated
    u: torch.Tensor | None = None,  # [P, S, R] fp32 scratch, else allocated
) -> torch.Tensor:  # [P, S * out_s] fp32
    """Every pair's LoRA delta (module doc); zeros for pairs with slot -1."""
    num_pairs = pair_slot.shape[0]
    num_slices, rank, in_f = a.shape[0], a.shape[3], a.shape[4]
    out_total = b.shape[2]
    out_s = out_total // num_slices
    if out is None:
        out = torch.empty(num_pairs, out_total, dtype=torch.float32, device=inp.device)
    if num_pairs == 0:
        return out
    if u is None:
        u = torch.empty(num_pairs, num_slices, rank, dtype=torch.float32, device=inp.device)
    if slot_rank is None:
        slot_rank = torch.full((a.shape[1],), rank, dtype=torch.int32, device=inp.device)
    block_r = triton.next_power_of_2(rank)
    block_k = max(16, min(128, triton.next_power_of_2(in_f)))
    _pair_shrink_kernel[(num_pairs, num_slices)](
        inp, a, scaling, u, pair_slot, pair_expert, slot_rank, row_div, in_f, rank,
        inp.stride(0), inp.stride(1), *a.stride(), *scaling.stride(), *u.stride(),
        BLOCK_R=block_r, BLOCK_K=block_k,
    )
    block_n = max(16, min(64, triton.next_power_of_2(out_s)))
    _pair_expand_kernel[(num_pairs, num_slices, triton.cdiv(out_s, block_n))](
        u, b, out, pair_slot, pair_expert, slot_rank, out_s, rank, *u.stride(), *b.stride(), *out.stride(),
        BLOCK_N=block_n, BLOCK_R=block_r,
    )
    return out


def expert_pair_slots(lora: ExpertLoRA, top_k: int) -> torch.Tensor:  # [T * k] int64
    """Each pair's slot: its token's, repeated for the token's k experts (device op)."""
    return lora.token_slot.repeat_interleave(top_k)
