"""Exp(1) noise for the sampler's exponential race: argmax(p / q) with q ~ Exp(1) per token
draws a token with probability p (one sync-free op over the batch, as vLLM's sampler does).

Rows without a seed share one generator; a seeded row draws from its own, seeded per draw
(``sampler.row_seed``), over its own candidates only, so its token does not depend on the rest
of its batch. On the CPU the noise comes from numpy, whose exponential sampler is about 4x
torch's there (over a 49k vocabulary about 1 ms a row with torch, more than the filters).
"""

from __future__ import annotations

import numpy as np
import torch


class RaceNoise:
    """Makes the noise of one draw: ``noise(probs, seeds, widths)`` -> a tensor like ``probs``."""

    def __init__(self, seed: int, device: torch.device):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.host_generator = np.random.default_rng(seed)

    def __call__(self, probs: torch.Tensor, seeds: list[int | None], widths: list[int] | None = None
                 ) -> torch.Tensor:
        """Noise for ``probs`` ([n, width]). ``seeds``: each row's draw seed (None: the shared
        generator); a seeded row's noise covers its first ``widths[row]`` columns (all without
        ``widths``), and is 1 past them (where p is 0)."""
        if probs.device.type == "cpu" and probs.dtype == torch.float32:
            return self._on_host(tuple(probs.shape), seeds, widths)
        noise = torch.empty_like(probs)
        unseeded = [i for i, seed in enumerate(seeds) if seed is None]
        if unseeded:
            noise[unseeded] = torch.empty(
                len(unseeded), probs.shape[1], dtype=probs.dtype, device=probs.device
            ).exponential_(generator=self.generator)
        for i, seed in enumerate(seeds):
            if seed is not None:
                gen = torch.Generator(device=probs.device)
                gen.manual_seed(seed)
                width = probs.shape[1] if widths is None else widths[i]
                noise[i, :width].exponential_(generator=gen)
                noise[i, width:] = 1.0
        return noise

    def _on_host(self, shape: tuple[int, int], seeds: list[int | None], widths: list[int] | None) -> torch.Tensor:
        noise = np.empty(shape, dtype=np.float32)
        unseeded = [i for i, seed in enumerate(seeds) if seed is None]
        if unseeded:
            noise[unseeded] = self.host_generator.standard_exponential((len(unseeded), shape[1]), dtype=np.float32)
        for i, seed in enumerate(seeds):
            if seed is not None:
                width = shape[1] if widths is None else widths[i]
                noise[i, :width] = np.random.default_rng(seed).standard_exponential(width, dtype=np.float32)
                noise[i, width:] = 1.0
        # numpy's float32 draws include exact zeros: 0 / 0 (NaN, which argmax takes) would pick a
        # token the filters dropped
        np.maximum(noise, np.finfo(np.float32).tiny, out=noise)
        return torch.from_numpy(noise)
