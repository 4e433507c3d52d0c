"""HostStaging: a step's values reach the device buffers, padding rows get their fill, and what a
step does not write keeps its value (the CUDA-graph padding contract relies on both)."""

from __future__ import annotations

import numpy as np
import torch

from loraplex.engine.host_staging import HostStaging


def test_put_writes_values_then_fill_and_leaves_the_rest():
    rng = np.random.default_rng(7)
    staging = HostStaging(torch.device("cpu"))
    buffer = torch.full((16,), 123, dtype=torch.int64)
    written = 0  # rows some step has written
    for step in range(3):  # the twin is reused across steps: nothing of an earlier step leaks in
        n, rows = 3 + step, 10 - step
        values = rng.integers(0, 1000, n)
        staging.begin()
        staging.put(buffer, values, rows, fill=-1)
        staging.end()
        written = max(written, rows)
        expected = np.full(16, 123)
        expected[:written] = -1  # rows past this step's, written by an earlier one, keep its fill
        expected[:n] = values
        assert buffer.tolist() == expected.tolist()


def test_put_of_a_list_without_rows_writes_just_the_list():
    staging = HostStaging(torch.device("cpu"))
    buffer = torch.full((6,), 9, dtype=torch.int32)
    staging.put(buffer, [4, 1, 3])
    assert buffer.tolist() == [4, 1, 3, 9, 9, 9]


def test_put_2d_writes_the_leading_block_only():
    rng = np.random.default_rng(11)
    staging = HostStaging(torch.device("cpu"))
    buffer = torch.full((5, 7), -5, dtype=torch.int32)
    first = rng.integers(0, 50, (4, 6)).astype(np.int32)
    staging.put(buffer, first)
    second = rng.integers(50, 100, (2, 3)).astype(np.int32)  # fewer rows and columns next step
    staging.put(buffer, second)
    expected = np.full((5, 7), -5)
    expected[:4, :6] = first
    expected[:2, :3] = second
    assert buffer.numpy().tolist() == expected.tolist()
