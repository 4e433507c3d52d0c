"""A projection's LoRA shrink on a second CUDA stream, beside the base matmul (``overlap_lora_shrink``).

Why: at decode sizes the shrink is a small, latency-bound launch (the H200 calls of 2026-12-04:
43-48% of the copy bandwidth for qkv and down at 256 tokens over 64 adapters, and the largest
LoRA kernel of a graph step), and it reads nothing but the projection's input, as the base
matmul does. Run side by side, the shrink can take the SMs and bandwidth the matmul leaves; the
expand adds into the base output, so it waits for both.

The order kept between the two streams, which is what makes it safe (under CUDA-graph capture
these waits become the graph's edges, so a replay keeps it too):

- before each shrink the side stream waits for the current one: the input is written, and the
  previous projection's expand has read the shrink buffer the side stream is about to overwrite;
- before the expand the current stream waits for the side one.

Everything the side stream reads or writes (the input, the slot pool's stacks, the metadata, the
shrink buffer) stays referenced until after the join, and later work on the current stream
follows the join, so the caching allocator never hands those bytes to other work too early.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


class ShrinkOverlap:
    """Runs ``shrink`` on a side stream while ``base`` runs on the current one (see module doc).

    ``current`` and ``use`` are the stream calls (``torch.cuda.current_stream`` and
    ``torch.cuda.stream``); tests pass recording stand-ins to check the order without a GPU."""

    def __init__(self, stream, current: Callable[[], object] | None = None,
                 use: Callable[[object], AbstractContextManager] | None = None):
        self.stream = stream
        self._current = current or (lambda: torch.cuda.current_stream(stream.device))
        self._use = use or torch.cuda.stream

    @classmethod
    def on(cls, device: torch.device) -> ShrinkOverlap:
        return cls(torch.cuda.Stream(device=device))

    def run(self, shrink: Callable[[], T], base: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, T]:
        """``(base(), shrink())``, the two queued on different streams; work queued on the current
        stream after this returns runs after both."""
        current = self._current()
        self.stream.wait_stream(current)
        with self._use(self.stream):
            shrunk = shrink()
        y = base()
        current.wait_stream(self.stream)
        return y, shrunk
