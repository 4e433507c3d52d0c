"""Batched CPU twin of the segmented LoRA shrink/expand (same arguments and result as
``lora_ref``, which stays the test oracle).

``lora_ref`` runs a few small torch ops per segment and slice; with tens of adapters in a decode
step that is thousands of tiny ops per step. Here the short segments of one real rank are one
padded batch, ``[G, L, in] @ [G, in, r]`` for all slices at once, reading the stacked weights
through a view when the batch's slots are evenly spaced (else per run of consecutive slots, or
a gather). A call costs a handful of ops whatever the number of adapters, and every adapter
still computes with its own rank (a rank-8 adapter never pays for a rank-64 one). Long segments
(prefill chunks) run alone, unpadded.

Fast on CPU only in fp32: AVX2 hosts run small bf16 batched matmuls about ten times slower, so
the slot pool keeps fp32 stacks on CPU (``LoRAManager``); inputs are converted to the stacks' dtype.

The grouping plan depends only on the step's metadata, so it is built once per step and kept in
``meta.scratch``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.kernels.lora_meta import LoRABatchMeta


# Segments at least this long run alone (no padding); shorter ones of one rank are batched,
# padded to the longest of them, so padding never costs more than this many rows a segment.
LONG_SEGMENT = 16
# A batch whose slots are not evenly spaced is split into runs of consecutive slots (views of
# the stacks, no copy) up to this many runs; past that the weights are gathered (a copy).
MAX_RUNS = 4


@dataclass
class _Batch:
    """Segments of one real rank computed as one padded batch ``[G, L, in] @ [G, in, r]``."""

    rank: int
    slots: slice | torch.Tensor  # index into the max_loras dim: a view when a slice
    rows: torch.Tensor  # [G, L] int64 permuted rows (padding repeats a real row)
    tokens: torch.Tensor  # [G, L] int64 original token indices, token_perm[rows]
    valid: torch.Tensor | None  # [n] flat positions in G*L of real rows; None = no padding
    rows_valid: torch.Tensor  # [n] int64
    tokens_valid: torch.Tensor  # [n] int64


def _slot_index(slots: list[int]) -> slice | torch.Tensor:
    if len(slots) == 1:
        return slice(slots[0], slots[0] + 1)
    step = slots[1] - slots[0]
    if step > 0 and all(b - a == step for a, b in zip(slots, slots[1:])):
        return slice(slots[0], slots[-1] + 1, step)
    return torch.tensor(slots, dtype=torch.int64)


def _batch(rank: int, segs: list[tuple[int, int, int]], perm_host: torch.Tensor) -> _Batch:
    length = max(hi - lo for _, lo, hi in segs)
    rows, valid = [], []
    for i, (_, lo, hi) in enumerate(segs):
        rows.extend(range(lo, hi))
        rows.extend([lo] * (length - (hi - lo)))
        valid.extend(range(i * length, i * length + hi - lo))
    rows_t = torch.tensor(rows, dtype=torch.int64).view(len(segs), length)
    tokens_t = perm_host[rows_t]
    padded = len(valid) != len(rows)
    valid_t = torch.tensor(valid, dtype=torch.int64) if padded else None
    flat_rows, flat_tokens = rows_t.view(-1), tokens_t.view(-1)
    return _Batch(
        rank=rank,
        slots=_slot_index([s for s, _, _ in segs]),
        rows=rows_t,
        tokens=tokens_t,
        valid=valid_t,
        rows_valid=flat_rows[valid_t] if padded else flat_rows,
        tokens_valid=flat_tokens[valid_t] if padded else flat_tokens,
    )


def _runs(segs: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    runs = [[segs[0]]]
    for seg in segs[1:]:
        if seg[0] == runs[-1][-1][0] + 1:
            runs[-1].append(seg)
        else:
            runs.append([seg])
    return runs


def _plan(meta: LoRABatchMeta) -> list[_Batch]:
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
    perm_host = meta.token_perm.cpu()
    plan = []
    for rank, segs in sorted(by_rank.items()):
        short = sorted(s for s in segs if s[2] - s[1] < LONG_SEGMENT)
        plan.extend(_batch(rank, [s], perm_host) for s in segs if s[2] - s[1] >= LONG_SEGMENT)
        if not short:
            continue
        if isinstance(_slot_index([s for s, _, _ in short]), slice):
            plan.append(_batch(rank, short, perm_host))
            continue
        runs = _runs(short)
        groups = runs if len(runs) <= MAX_RUNS else [short]
        plan.extend(_batch(rank, grp, perm_host) for grp in groups)
    meta.scratch["lora_cpu"] = plan
    return plan


def lora_shrink_cpu(
    x: torch.Tensor,  # [num_tokens, in]
    a_stack: torch.Tensor,  # [num_slices, max_loras, r_max, in]
    meta: LoRABatchMeta,
    out: torch.Tensor,  # [num_slices, num_tokens, r_max] fp32, permuted rows
) -> None:
    num_slices = a_stack.shape[0]
    for bt in _plan(meta):
        g, length = bt.rows.shape
        xg = x[bt.tokens].to(a_stack.dtype)  # [G, L, in]
        a = a_stack[:, bt.slots, : bt.rank]  # [num_slices, G, r, in]
        shrunk = torch.matmul(xg.unsqueeze(0), a.transpose(-1, -2))  # [num_slices, G, L, r]
        shrunk = shrunk.reshape(num_slices, g * length, bt.rank)
        if bt.valid is not None:
            shrunk = shrunk[:, bt.valid]
        out[:, bt.rows_valid, : bt.rank] = shrunk.float()


def lora_expand_cpu(
    shrunk: torch.Tensor,  # [num_slices, num_tokens, r_max] fp32
    b_stack: torch.Tensor,  # [max_loras, out_total, r_max]
    scaling: torch.Tensor,  # [num_slices, max_loras] fp32
    slice_offsets: tuple[int, ...],
    meta: LoRABatchMeta,
    y: torch.Tensor,  # [num_tokens, out_total]
) -> None:
    num_slices = len(slice_offsets) - 1
    for bt in _plan(meta):
        g, length = bt.rows.shape
        sh = shrunk[:, bt.rows, : bt.rank]  # [num_slices, G, L, r] fp32
        sh = (sh * scaling[:, bt.slots][:, :, None, None]).to(b_stack.dtype)
        b = b_stack[bt.slots, :, : bt.rank]  # [G, out_total, r]
        parts = [
            torch.matmul(sh[s], b[:, slice_offsets[s] : slice_offsets[s + 1]].transpose(1, 2))  # [G, L, out_s]
            for s in range(num_slices)
        ]
        delta = (parts[0] if num_slices == 1 else torch.cat(parts, dim=-1)).reshape(g * length, -1)
        if bt.valid is not None:
            delta = delta[bt.valid]
        y.index_add_(0, bt.tokens_valid, delta.to(y.dtype))
