"""Fused CPU twin of the segmented LoRA shrink + expand (same result as ``lora_ref``'s two
halves, which stay the test oracle), behind ``dispatch.lora_apply``.

``lora_ref`` runs a few small torch ops per segment and slice; with tens of adapters in a decode
step that is thousands of tiny ops per step. Here the segments of one real rank form padded
batches ``[G, L, in] @ [G, in, r]`` then ``[G, L, r] @ [G, r, out_s]``, reading the stacked
weights through strided views when the batch's slots are evenly spaced (else per run of
consecutive slots, or a gather). A projection costs a handful of ops whatever the number of
adapters, and every adapter computes with its own rank (a rank-8 adapter never pays for a
rank-64 one). Short segments (decodes) of a rank are one batch in slot order; long ones
(prefill chunks) are batched by length, with little padding. The runner orders the flat batch by
(rank, slot), so a batch's tokens are usually one run and x and y are views, not copies.

Fast on CPU only in fp32: AVX2 hosts run small bf16 batched matmuls about ten times slower, so
the slot pool keeps fp32 stacks on CPU (``LoRAManager``); inputs are converted to the stacks' dtype.

The grouping plan depends only on the step's metadata, so it is built once per step and kept in
``meta.scratch``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.kernels.lora_meta import LoRABatchMeta
from loraplex.kernels.padding import padded_groups


# Segments shorter than this (decodes, short chunks) of one rank form one batch in slot order,
# padded to the longest of them, so padding never costs more than this many rows a segment.
LONG_SEGMENT = 16
# Longer segments (prompt chunks) of one rank are batched by length: a batch's padded rows may
# exceed its real rows by this factor, so one long prompt never pads a batch of short ones.
MAX_PADDING_FACTOR = 1.25
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
    token_start: int | None  # unpadded and the tokens are token_start.. in order: x and y as views


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
    first = int(flat_tokens[0])
    in_order = not padded and torch.equal(flat_tokens, torch.arange(first, first + flat_tokens.numel()))
    return _Batch(
        rank=rank,
        slots=_slot_index([s for s, _, _ in segs]),
        rows=rows_t,
        tokens=tokens_t,
        valid=valid_t,
        rows_valid=flat_rows[valid_t] if padded else flat_rows,
        tokens_valid=flat_tokens[valid_t] if padded else flat_tokens,
        token_start=first if in_order else None,
    )


def _runs(segs: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    runs = [[segs[0]]]
    for seg in segs[1:]:
        if seg[0] == runs[-1][-1][0] + 1:
            runs[-1].append(seg)
        else:
            runs.append([seg])
    return runs


def _length_groups(segs: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """``(slot, lo, hi)`` segments cut into batches of similar length (see MAX_PADDING_FACTOR)."""
    return padded_groups(segs, lambda s: (s[2] - s[1],), MAX_PADDING_FACTOR)


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
        long = [s for s in segs if s[2] - s[1] >= LONG_SEGMENT]
        plan.extend(_batch(rank, sorted(grp), perm_host) for grp in _length_groups(long))
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


def lora_apply_cpu(
    x: torch.Tensor,  # [num_tokens, in] (original token order)
    a_stack: torch.Tensor,  # [num_slices, max_loras, r_max, in]
    b_stack: torch.Tensor,  # [max_loras, out_total, r_max]
    scaling: torch.Tensor,  # [num_slices, max_loras] fp32
    slice_offsets: tuple[int, ...],  # num_slices + 1 offsets into out_total
    meta: LoRABatchMeta,
    y: torch.Tensor,  # [num_tokens, out_total] base output, original order; updated in place
) -> None:
    """Shrink then expand, fused per batch of the plan: a batch's shrink result goes straight
    into its expand as ``[G, L, r]``, and every weight operand is a strided view of the stacks
    (bmm reads them in place). When the runner has ordered the flat batch by (rank, slot) a
    batch's tokens are one run, so x and y are read and updated through views as well; else
    they are gathered and scattered. Same result as ``lora_shrink_ref`` + ``lora_expand_ref``.
    """
    num_slices = a_stack.shape[0]
    x_gatherable = None
    for bt in _plan(meta):
        g, length = bt.rows.shape
        if bt.token_start is not None:
            t0, t1 = bt.token_start, bt.token_start + g * length
            xg = x[t0:t1].to(a_stack.dtype).view(g, length, -1)  # [G, L, in]
            y3 = y[t0:t1].view(g, length, -1)  # [G, L, out_total]
        else:
            if x_gatherable is None:
                x_gatherable = x.to(a_stack.dtype)
            xg = x_gatherable[bt.tokens]
            y3 = None
        scales = scaling[:, bt.slots].to(a_stack.dtype).view(num_slices, -1, 1, 1)  # [num_slices, G, 1, 1]
        parts = []
        for s in range(num_slices):
            o0, o1 = slice_offsets[s], slice_offsets[s + 1]
            a = a_stack[s, bt.slots, : bt.rank]  # [G, r, in]
            b = b_stack[bt.slots, o0:o1, : bt.rank]  # [G, out_s, r]
            delta = torch.bmm(torch.bmm(xg, a.transpose(1, 2)).mul_(scales[s]), b.transpose(1, 2))  # [G, L, out_s]
            if y3 is not None:
                y3[:, :, o0:o1].add_(delta)
            else:
                parts.append(delta)
        if y3 is not None:
            continue
        delta = (parts[0] if num_slices == 1 else torch.cat(parts, dim=-1)).view(g * length, -1)
        if bt.valid is not None:
            delta = delta[bt.valid]
        y.index_add_(0, bt.tokens_valid, delta.to(y.dtype))
