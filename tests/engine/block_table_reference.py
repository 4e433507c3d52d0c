"""The block tables of a step copied afresh from the sequences' lists: the reference that the
runner's ``BlockTableMirror`` (updated by what changed) is tested against."""

from __future__ import annotations

import numpy as np


def block_table_rows(tables: list[list[int]], seq_lens: list[int], block_size: int, width: int | None = None,
                     first_blocks: list[int] | None = None) -> np.ndarray:
    """[num_seqs, width] int32: each sequence's first ``ceil(seq_len / block_size)`` blocks,
    copied afresh from the lists,
    padded with 0 (``width`` defaults to the longest row). ``first_blocks``: per row, the entries
    before it are -1 without being read from the table (a windowed layer group's entries before
    its window, which no kernel reads: copying only the window keeps a long context's rows cheap)."""
    lengths = [-(-n // block_size) for n in seq_lens]
    out = np.zeros((len(tables), max(lengths) if width is None else width), dtype=np.int32)
    if first_blocks is None:
        for i, (table, length) in enumerate(zip(tables, lengths)):
            out[i, :length] = table[:length]
        return out
    for i, (table, length, first) in enumerate(zip(tables, lengths, first_blocks)):
        first = min(first, length)
        out[i, :first] = -1
        out[i, first:length] = table[first:length]
    return out
