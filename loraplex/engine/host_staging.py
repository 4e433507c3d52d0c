"""Page-locked host twins of a CUDA graph's static input buffers, copied in without waiting.

A ``copy_`` from ordinary (pageable) host memory into a CUDA tensor returns only when the copy
is done. In graph-replayed decode steps on the H200 of 2026-12-04 the nine such copies of a step
with LoRA took 0.43 ms of its 6.1 ms (about 45 us each: the copies of the decode inputs 0.29 ms,
of the LoRA metadata 0.14 ms; kernels/RESULTS.md, the step-phase table). From page-locked memory
a ``non_blocking`` copy is queued on the stream like a kernel, ahead of the replay that reads
its buffer, and the host goes on. The price: a twin must not be rewritten before its last copy
has read it, so each step waits for the previous step's copies first (long done by then: a step
ends by reading its sampled tokens back; with ``schedule_ahead`` the step launched just before
may still be queued, but behind nothing the host has not read back already, so its copies come
first).
"""

from __future__ import annotations

import numpy as np
import torch


class HostStaging:
    """Host twins of device buffers: ``put`` writes a step's values into the twin and queues the
    copy; ``begin`` (before a step's first ``put``) waits until the previous step's copies have
    read the twins. On a CPU device the twins are plain memory and every copy is immediate."""

    def __init__(self, device: torch.device):
        self.is_async = device.type == "cuda"
        self._twins: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(buffer) -> (buffer, flat twin)
        self._copied: torch.cuda.Event | None = None  # recorded after the last step's copies

    def begin(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def end(self) -> None:
        """Mark the step's copies queued so far (the next ``begin`` waits for them)."""
        if self.is_async:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def put(self, buffer: torch.Tensor, values: np.ndarray, rows: int | None = None, fill: int = 0) -> None:
        """``buffer[:n, :w] = values`` (``values`` [n] or [n, w], ``buffer`` of as many dims), and for a
        1-D buffer ``buffer[n:rows] = fill``; rows of a 2-D buffer past ``n`` keep what they held."""
        twin = self._twin(buffer)
        if buffer.dim() == 1:
            rows = len(values) if rows is None else rows
            host = twin[:rows]
            view = host.numpy()
            view[: len(values)] = values
            view[len(values) :] = fill
            buffer[:rows].copy_(host, non_blocking=self.is_async)
            return
        n, w = values.shape
        host = twin[: n * w].view(n, w)  # contiguous, so the copy reads it in one piece
        host.numpy()[:] = values
        buffer[:n, :w].copy_(host, non_blocking=self.is_async)

    def _twin(self, buffer: torch.Tensor) -> torch.Tensor:
        found = self._twins.get(id(buffer))
        if found is None or found[0] is not buffer:
            flat = torch.empty(buffer.numel(), dtype=buffer.dtype, pin_memory=self.is_async)
            found = self._twins[id(buffer)] = (buffer, flat)
        return found[1]
