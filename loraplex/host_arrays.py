"""Per-step host lists into tensors, cheaply.

``torch.tensor`` on a Python list infers each element's type; going through numpy is about 3x
faster on the lists a step builds (a 256 x 63 block table at a 1,000-token context: 1.3 ms vs
0.5 ms on the CI VM), and the step's host time is what keeps a GPU waiting at large batches.
Top-level, not in ``engine``: the LoRA batch metadata (``lora.context``) goes up the same way,
and ``lora`` does not import ``engine``.
"""

from __future__ import annotations

import numpy as np
import torch


def to_tensor(values, dtype: np.dtype | type, device: torch.device | str = "cpu") -> torch.Tensor:
    """A host list (or nested list of equal rows) as a tensor on ``device``."""
    return to_device(np.asarray(values, dtype=dtype), device)


def to_device(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """``array`` as a tensor on ``device``. To a GPU through page-locked memory, queued without
    waiting: a copy from ordinary memory returns only once the stream has run everything queued
    before it, which with ``schedule_ahead`` is the whole step before."""
    tensor = torch.from_numpy(array)
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


# the numpy twin of each torch dtype the sampler's per-row lists take (bfloat16 has none)
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64,
                 torch.int64: np.int64, torch.int32: np.int32, torch.bool: np.bool_}


def values_to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A per-row list (the sampler's options, row indices) as a ``dtype`` tensor on ``device``,
    copied without waiting for the stream (``to_device``): a step scheduled ahead must not wait
    for the one before."""
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is None:
        return torch.tensor(values, dtype=dtype, device=device)
    return to_device(np.asarray(values, dtype=np_dtype), device)
