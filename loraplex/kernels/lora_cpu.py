"""Batched CPU twin of the segmented LoRA shrink/expand (same arguments and result as
``lora_ref``, which stays the test oracle).

``lora_ref`` runs a few small torch ops per segment and slice; with tens of adapters in a decode
step that is thousands of tiny ops per step. Here the segments are grouped by their slot's real
rank and each group is one padded batch: ``[G, L, in] @ [G, in, r]`` for all slices at once, so a
call costs a handful of ops whatever the number of adapters, and every adapter still computes
with its own rank (a rank-8 adapter never pays for a rank-64 one).

The grouping plan depends only on the step's metadata, so it is built once per step and kept in
``meta.scratch``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.kernels.lora_meta import LoRABatchMeta


@dataclass
class _RankGroup:
    """Segments whose slots share one real rank, padded to the longest of them."""

    rank: int
    slots: torch.Tensor  # [G] int64
    rows: torch.Tensor  # [G, L] int64 permuted rows (padding repeats a real row)
    tokens: torch.Tensor  # [G, L] int64 original token indices, token_perm[rows]
    valid: torch.Tensor | None  # [n] flat positions in G*L of real rows; None = no padding
    rows_valid: torch.Tensor  # [n] int64
    tokens_valid: torch.Tensor  # [n] int64


def _plan(meta: LoRABatchMeta) -> list[_RankGroup]:
    plan = meta.scratch.get("lora_cpu")
    if plan is not None:
        return plan
    by_rank: dict[int, list[tuple[int, int, int]]] = {}
    starts = meta.seg_starts_host
    for g, slot in enumerate(meta.seg_slot_host):
        lo, hi = starts[g], starts[g + 1]
        rank = meta.slot_rank_host[slot] if slot >= 0 else 0
        if slot < 0 or hi <= lo or rank <= 0:
            continue
        by_rank.setdefault(rank, []).append((slot, lo, hi))
    perm_host = None
    plan = []
    for rank, segs in sorted(by_rank.items()):
        length = max(hi - lo for _, lo, hi in segs)
        rows, valid = [], []
        for i, (_, lo, hi) in enumerate(segs):
            n = hi - lo
            rows.extend(range(lo, hi))
            rows.extend([lo] * (length - n))
            valid.extend(range(i * length, i * length + n))
        rows_t = torch.tensor(rows, dtype=torch.int64).view(len(segs), length)
        if perm_host is None:
            perm_host = meta.token_perm.cpu()
        tokens_t = perm_host[rows_t]
        padded = len(valid) != len(rows)
        valid_t = torch.tensor(valid, dtype=torch.int64) if padded else None
        flat_rows = rows_t.view(-1)
        flat_tokens = tokens_t.view(-1)
        plan.append(
            _RankGroup(
                rank=rank,
                slots=torch.tensor([s for s, _, _ in segs], dtype=torch.int64),
                rows=rows_t,
                tokens=tokens_t,
                valid=valid_t,
                rows_valid=flat_rows[valid_t] if padded else flat_rows,
                tokens_valid=flat_tokens[valid_t] if padded else flat_tokens,
            )
        )
    meta.scratch["lora_cpu"] = plan
    return plan


def lora_shrink_cpu(
    x: torch.Tensor,  # [num_tokens, in]
    a_stack: torch.Tensor,  # [num_slices, max_loras, r_max, in]
    meta: LoRABatchMeta,
    out: torch.Tensor,  # [num_slices, num_tokens, r_max] fp32, permuted rows
) -> None:
    num_slices = a_stack.shape[0]
    for grp in _plan(meta):
        g, length = grp.rows.shape
        xg = x[grp.tokens].to(a_stack.dtype)  # [G, L, in]
        a = a_stack[:, grp.slots, : grp.rank]  # [num_slices, G, r, in]
        shrunk = torch.matmul(xg.unsqueeze(0), a.transpose(-1, -2))  # [num_slices, G, L, r]
        shrunk = shrunk.reshape(num_slices, g * length, grp.rank)
        if grp.valid is not None:
            shrunk = shrunk[:, grp.valid]
        out[:, grp.rows_valid, : grp.rank] = shrunk.float()


def lora_expand_cpu(
    shrunk: torch.Tensor,  # [num_slices, num_tokens, r_max] fp32
    b_stack: torch.Tensor,  # [max_loras, out_total, r_max]
    scaling: torch.Tensor,  # [num_slices, max_loras] fp32
    slice_offsets: tuple[int, ...],
    meta: LoRABatchMeta,
    y: torch.Tensor,  # [num_tokens, out_total]
) -> None:
    num_slices = len(slice_offsets) - 1
    for grp in _plan(meta):
        g, length = grp.rows.shape
        sh = shrunk[:, grp.rows, : grp.rank]  # [num_slices, G, L, r] fp32
        sh = (sh * scaling[:, grp.slots][:, :, None, None]).to(b_stack.dtype)
        b = b_stack[grp.slots, :, : grp.rank]  # [G, out_total, r]
        parts = [
            torch.matmul(sh[s], b[:, slice_offsets[s] : slice_offsets[s + 1]].transpose(1, 2))  # [G, L, out_s]
            for s in range(num_slices)
        ]
        delta = (parts[0] if num_slices == 1 else torch.cat(parts, dim=-1)).reshape(g * length, -1)
        if grp.valid is not None:
            delta = delta[grp.valid]
        y.index_add_(0, grp.tokens_valid, delta.to(y.dtype))
