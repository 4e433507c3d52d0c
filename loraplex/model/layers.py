"""Small building blocks of the decoder: per-step attention metadata and RMSNorm."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where each token of the flat batch lives in the paged KV cache (DESIGN.md contracts).

    Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``: the last ``q_len``
    of its ``seq_lens[i]`` positions (cached prefix + this step's tokens).

    Layer groups (``engine.kv_layout``): when the layers keep their KV in pages of their own
    group, each group has its own slot mapping and block tables and ``layer_group`` says which
    group a layer reads; ``slot_mapping`` / ``block_tables`` are group 0's. Without groups
    (``layer_group`` None) every layer reads those two.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, block * block_size + offset
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int  # host ints, so kernel grids need no device sync
    max_seq_len: int
    group_slot_mappings: list[torch.Tensor] | None = None  # per group [num_tokens] int64
    group_block_tables: list[torch.Tensor] | None = None  # per group [num_seqs, max_blocks] int32
    layer_group: tuple[int, ...] | None = None  # per layer: its group

    @property
    def num_groups(self) -> int:
        return 1 if self.layer_group is None else len(self.group_block_tables)

    def group_of(self, layer: int) -> int:
        return 0 if self.layer_group is None else self.layer_group[layer]

    def slots_of(self, group: int) -> torch.Tensor:  # [num_tokens] int64
        return self.slot_mapping if self.layer_group is None else self.group_slot_mappings[group]

    def tables_of(self, group: int) -> torch.Tensor:  # [num_seqs, max_blocks] int32
        return self.block_tables if self.layer_group is None else self.group_block_tables[group]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as HF Llama computes it: statistics in fp32, scaled in the input dtype.

    Written out rather than ``F.rms_norm``, which on CPU (torch 2.13) is ~9x slower at prefill
    sizes ([2048, 576]) and rounds differently from transformers."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)
