"""The per-step list-to-tensor helpers agree with building the same tensors with torch.tensor."""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from loraplex.host_arrays import to_tensor
from tests.engine.block_table_reference import block_table_rows


def test_block_table_rows_cut_each_table_at_its_length_and_pad_with_zero():
    rng = random.Random(11)
    block_size = 16
    seq_lens = [rng.randint(1, 200) for _ in range(9)] + [block_size, block_size + 1]
    # tables may hold more blocks than the sequence uses (allocated ahead); those must not show
    tables = [rng.sample(range(1, 1000), math.ceil(n / block_size) + rng.randint(0, 3)) for n in seq_lens]
    width = max(math.ceil(n / block_size) for n in seq_lens)
    expected = torch.tensor(
        [t[: math.ceil(n / block_size)] + [0] * (width - math.ceil(n / block_size)) for t, n in zip(tables, seq_lens)],
        dtype=torch.int32,
    )
    got = torch.from_numpy(block_table_rows(tables, seq_lens, block_size))
    assert got.dtype == torch.int32 and torch.equal(got, expected)
    wide = block_table_rows(tables, seq_lens, block_size, width=width + 5)
    assert wide.shape == (len(tables), width + 5) and not wide[:, width:].any()


def test_to_tensor_keeps_values_and_dtype():
    values = [3, -1, 2**40, 0]
    t = to_tensor(values, np.int64)
    assert t.dtype == torch.int64 and t.tolist() == values
    assert to_tensor([[1, 2], [3, 4]], np.int32).dtype == torch.int32


def test_block_table_rows_leave_entries_before_first_blocks_as_freed():
    rng = random.Random(12)
    block_size = 4
    seq_lens = [rng.randint(1, 80) for _ in range(8)]
    tables = [rng.sample(range(1, 1000), math.ceil(n / block_size)) for n in seq_lens]
    first_blocks = [rng.randint(0, math.ceil(n / block_size) + 2) for n in seq_lens]  # some past the row
    width = max(math.ceil(n / block_size) for n in seq_lens)
    expected = []
    for t, n, first in zip(tables, seq_lens, first_blocks):
        length = math.ceil(n / block_size)
        expected.append([-1 if i < first else t[i] for i in range(length)] + [0] * (width - length))
    got = block_table_rows(tables, seq_lens, block_size, first_blocks=first_blocks)
    assert torch.equal(torch.from_numpy(got), torch.tensor(expected, dtype=torch.int32))
