"""Torch reference of the segmented-gather LoRA kernels (CPU path and the kernels' test oracle).

Same arguments as ``dispatch.lora_shrink`` / ``dispatch.lora_expand``. Each segment computes
with its slot's real rank, so a rank-8 adapter in a rank-64 engine pays rank-8 cost here too.
"""

from __future__ import annotations

import torch

from loraplex.kernels.lora_meta import LoRABatchMeta


def _segments(meta: LoRABatchMeta):
    starts = meta.seg_starts_host
    for g, slot in enumerate(meta.seg_slot_host):
        lo, hi = starts[g], starts[g + 1]
        if slot < 0 or hi <= lo:
            continue
        rank = meta.slot_rank_host[slot]
        if rank <= 0:
            continue
        yield lo, hi, slot, rank


def lora_shrink_ref(
    x: torch.Tensor,  # [num_tokens, in]
    a_stack: torch.Tensor,  # [num_slices, max_loras, r_max, in]
    meta: LoRABatchMeta,
    out: torch.Tensor,  # [num_slices, num_tokens, r_max] fp32, permuted rows
) -> None:
    for lo, hi, slot, rank in _segments(meta):
        rows = meta.token_perm[lo:hi]
        xs = x[rows].float()  # [seg_len, in]
        for s in range(a_stack.shape[0]):
            out[s, lo:hi, :rank] = xs @ a_stack[s, slot, :rank].float().t()


def lora_expand_ref(
    shrunk: torch.Tensor,  # [num_slices, num_tokens, r_max] fp32
    b_stack: torch.Tensor,  # [max_loras, out_total, r_max]
    scaling: torch.Tensor,  # [num_slices, max_loras] fp32
    slice_offsets: tuple[int, ...],
    meta: LoRABatchMeta,
    y: torch.Tensor,  # [num_tokens, out_total]
) -> None:
    scale_host = scaling.tolist()
    for lo, hi, slot, rank in _segments(meta):
        rows = meta.token_perm[lo:hi]
        delta = torch.empty(hi - lo, y.shape[1], dtype=torch.float32, device=y.device)
        for s in range(len(slice_offsets) - 1):
            o0, o1 = slice_offsets[s], slice_offsets[s + 1]
            b = b_stack[slot, o0:o1, :rank].float()  # [out_s, rank]
            delta[:, o0:o1] = (shrunk[s, lo:hi, :rank] @ b.t()) * scale_host[s][slot]
        y[rows] = (y[rows].float() + delta).to(y.dtype)
