"""Helpers shared by the model tests: run whole sequences through loraplex's decoder."""

from __future__ import annotations

import torch

from loraplex.model.layers import AttentionMetadata


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def new_kv_caches(spec, num_blocks: int, block_size: int, dtype=torch.float32) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    return [torch.zeros(shape, dtype=dtype) for _ in range(spec.num_layers)]


def chunk_metadata(
    chunks: list[tuple[int, int, list[int]]], block_size: int
) -> tuple[torch.Tensor, AttentionMetadata]:
    """``(positions, metadata)`` for chunks ``(start_pos, num_tokens, block_table)`` of sequences."""
    positions, slots, seq_lens, qsl, tables = [], [], [], [0], []
    for start, n, table in chunks:
        for pos in range(start, start + n):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        seq_lens.append(start + n)
        qsl.append(qsl[-1] + n)
        tables.append(table)
    width = max(len(t) for t in tables)
    attn = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        max_query_len=max(n for _, n, _ in chunks),
        max_seq_len=max(seq_lens),
    )
    return torch.tensor(positions, dtype=torch.int64), attn
