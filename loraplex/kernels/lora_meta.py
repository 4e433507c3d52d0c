"""LoRA batch metadata (DESIGN.md, "LoRA batch metadata"), built once per step by the runner and
shared by every LoRA layer of that step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoRABatchMeta:
    """Tokens of the flat batch grouped by adapter slot.

    ``token_perm`` is a stable sort of token indices by slot: permuted row ``i`` is original
    token ``token_perm[i]``. Segment ``g`` covers permuted rows ``seg_starts[g]:seg_starts[g+1]``
    and uses device slot ``seg_slot[g]`` (-1 = base model, skipped by the LoRA path).
    Only segments with a slot >= 0 need to be listed; base-only rows may be left out entirely.
    """

    token_perm: torch.Tensor  # [num_tokens] int64
    seg_starts: torch.Tensor  # [num_segments + 1] int32
    seg_slot: torch.Tensor  # [num_segments] int32
    slot_rank: torch.Tensor  # [max_loras] int32, real rank of each slot (0 = empty)
    num_tokens: int  # host-side counts, so no kernel launch needs a device->host sync
    num_segments: int
    max_seg_len: int
    max_rank: int  # max real rank over the slots present in this step
    # host copies (lists) used by the torch reference and by shape-based path selection
    seg_starts_host: list[int]
    seg_slot_host: list[int]
    slot_rank_host: list[int]
    # segments expected to hold rows, for launch sizing only (K splits, column tiles per
    # program); a CUDA graph's num_segments is an upper bound (spare segments exit at once), and
    # sizing by it would give the real segments fewer programs than an eager step. None = num_segments
    sizing_segments: int | None = None
    # per-step scratch a backend may fill lazily and reuse across the step's layers
    # (e.g. the CPU path's grouping plan); never part of the contract between runner and kernels
    scratch: dict = field(default_factory=dict, repr=False)
