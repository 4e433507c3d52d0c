"""The exponential race's noise (loraplex/engine/race_noise.py), on both of its ways: numpy's for
float32 on the CPU, torch's otherwise (the GPU's; here float64 on the CPU takes it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loraplex.engine.race_noise import RaceNoise
from loraplex.engine.sampler import row_argmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["numpy", "torch"])
def test_a_seeded_rows_noise_is_its_own(dtype):
    """A seeded row's noise depends on its seed and width only: the same beside other rows, in
    another position, from another generator state; 1 past its width; unseeded rows differ
    from call to call; all of it positive."""
    probs = torch.full((4, 64), 1 / 64, dtype=dtype)
    noise = RaceNoise(0, torch.device("cpu"))
    first = noise(probs, [11, None, 22, None], [64, 64, 40, 64])
    assert first.dtype == dtype and first.shape == probs.shape and bool((first > 0).all())
    assert bool((first[2, 40:] == 1.0).all()) and not bool((first[2, :40] == 1.0).all())
    again = RaceNoise(5, torch.device("cpu"))(probs[:2], [22, 11], [40, 64])
    assert torch.equal(again[0], first[2]) and torch.equal(again[1], first[0])
    later = noise(probs, [11, None, 22, None], [64, 64, 40, 64])
    assert torch.equal(later[[0, 2]], first[[0, 2]]) and not torch.equal(later[[1, 3]], first[[1, 3]])
    # Exp(1): mean 1 over many draws
    big = noise(torch.full((64, 4096), 1.0, dtype=dtype), [None] * 64)
    assert abs(big.double().mean().item() - 1.0) < 0.01


def test_a_zero_draw_never_picks_a_dropped_token():
    """numpy's float32 exponential draws can be exactly 0; with p = 0 (a token the filters
    dropped) that would be 0 / 0, NaN, which argmax takes. The noise is kept above 0."""
    noise = RaceNoise(0, torch.device("cpu"))

    class Zeros:
        def standard_exponential(self, size, dtype):
            return np.zeros(size, dtype=dtype)

    noise.host_generator = Zeros()
    probs = torch.zeros(3, 16)
    probs[:, 5] = 0.7
    probs[:, 9] = 0.3
    drawn = row_argmax(probs / noise(probs, [None, None, None]))
    assert set(drawn.tolist()) <= {5, 9}
