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
        n, width = probs.shape
        on_host = probs.device.type == "cpu" and probs.dtype == torch.float32
        noise = np.empty((n, width), dtype=np.float32) if on_host else torch.empty_like(probs)
        draw = self._on_host if on_host else (lambda seed, shape: self._on_device(seed, shape, probs))
        unseeded = [i for i, seed in enumerate(seeds) if seed is None]
        if unseeded:
            noise[unseeded] = draw(None, (len(unseeded), width))
        for i, seed in enumerate(seeds):
            if seed is not None:
                row_width = width if widths is None else widths[i]
                noise[i, :row_width] = draw(seed, (row_width,))
                noise[i, row_width:] = 1.0
        if not on_host:
            return noise
        # numpy's float32 draws include exact zeros: 0 / 0 (NaN, which argmax takes) would pick a
        # token the filters dropped
        np.maximum(noise, np.finfo(np.float32).tiny, out=noise)
        return torch.from_numpy(noise)

    def _on_host(self, seed: int | None, shape: tuple[int, ...]) -> np.ndarray:
        generator = self.host_generator if seed is None else np.random.default_rng(seed)
        return generator.standard_exponential(shape, dtype=np.float32)

    def _on_device(self, seed: int | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        generator = self.generator
        if seed is not None:
            generator = torch.Generator(device=like.device)
            generator.manual_seed(seed)
        return torch.empty(shape, dtype=like.dtype, device=like.device).exponential_(generator=generator)
