"""Builders shared by the kernel tests: LoRA batch metadata and NaN-poisoned outputs."""

from __future__ import annotations

import dataclasses

import torch

from loraplex.kernels.lora_meta import LoRABatchMeta


def make_meta(token_slots: list[int], slot_rank: list[int], empty_segments: int = 0) -> LoRABatchMeta:
    """Metadata for a flat batch whose token ``t`` uses slot ``token_slots[t]`` (-1 = base).

    Tokens are grouped by a stable sort on slot (base tokens first, as a runner would list them),
    one segment per distinct slot; ``empty_segments`` extra zero-length segments are inserted
    between them, so kernels must skip segments that own no rows.
    """
    slots = torch.tensor(token_slots, dtype=torch.int64)
    perm = torch.sort(slots, stable=True).indices
    sorted_slots = slots[perm].tolist()
    seg_starts, seg_slot = [0], []
    for i, slot in enumerate(sorted_slots):
        if i == 0 or slot != sorted_slots[i - 1]:
            if i > 0:
                seg_starts.append(i)
            seg_slot.append(slot)
    if sorted_slots:
        seg_starts.append(len(sorted_slots))
    else:
        seg_starts = [0]
    # empty segments: repeat a boundary (each points at a live slot, so only its length says "skip")
    live = [s for s in range(len(slot_rank)) if slot_rank[s] > 0] or [0]
    for j in range(empty_segments):
        at = (j * 7) % (len(seg_slot) + 1)
        seg_starts.insert(at, seg_starts[at])
        seg_slot.insert(at, live[j % len(live)])
    seg_lens = [seg_starts[g + 1] - seg_starts[g] for g in range(len(seg_slot))]
    present = {s for s in seg_slot if s >= 0}
    return LoRABatchMeta(
        token_perm=perm,
        seg_starts=torch.tensor(seg_starts, dtype=torch.int32),
        seg_slot=torch.tensor(seg_slot, dtype=torch.int32),
        slot_rank=torch.tensor(slot_rank, dtype=torch.int32),
        num_tokens=len(token_slots),
        num_segments=len(seg_slot),
        max_seg_len=max(seg_lens, default=0),
        max_rank=max((slot_rank[s] for s in present), default=0),
        seg_starts_host=seg_starts,
        seg_slot_host=seg_slot,
        slot_rank_host=list(slot_rank),
    )


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Fresh normal values (never zeros), made in float32 then cast."""
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere gives NaN (which fails every bound)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def padded_like_a_graph(meta: LoRABatchMeta, num_segments: int, sizing: bool) -> LoRABatchMeta:
    """``meta`` as a CUDA graph's static metadata lists it: empty spare segments up to
    ``num_segments`` (the runner's ``min(batch, max_loras)``), with or without the sizing hint
    (``sizing_segments``: the segments that hold rows). Also the GPU check's (kernels/bench_kernels.py)."""
    spare = num_segments - meta.num_segments
    return dataclasses.replace(
        meta,
        seg_starts=torch.cat([meta.seg_starts, meta.seg_starts[-1:].repeat(spare)]),
        seg_slot=torch.cat([meta.seg_slot, torch.zeros(spare, dtype=torch.int32, device=meta.seg_slot.device)]),
        num_segments=num_segments,
        seg_starts_host=meta.seg_starts_host + meta.seg_starts_host[-1:] * spare,
        seg_slot_host=meta.seg_slot_host + [0] * spare,
        sizing_segments=meta.num_segments if sizing else None,
    )
