"""CPU matmuls for the decoder's linears: weights prepacked once for oneDNN.

``F.linear`` on CPU repacks the weight into the GEMM's blocked layout on every call; at decode
batch sizes that costs about as much as the multiply. ``PrepackedLinear`` packs once at load
(oneDNN's ``_reorder_linear_weight``, the path torch.compile's CPU freezing uses) and runs
``mkldnn._linear_pointwise``; where that op is missing it falls back to ``F.linear``.

bfloat16 on a CPU without native bf16 matmul (no AVX512-BF16 / AMX, e.g. AVX2-only parts): the
bf16 GEMM is emulated and about 3x slower than fp32, so the weights are kept as fp32 copies of
their bf16 values, inputs are widened, and outputs rounded back to bf16. That is what a native
bf16 GEMM computes (bf16 operands, fp32 accumulation), up to summation order; activations and
the KV cache stay bf16. Cost: fp32-sized weight memory.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def onednn_linear_available() -> bool:
    """True when oneDNN's prepacked fp32 linear works on this build and CPU (probed once)."""
    try:
        w = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
        x = torch.arange(8, dtype=torch.float32).reshape(2, 4) / 5
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 2)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(y, F.linear(x, w), rtol=1e-5, atol=1e-6))
    except (AttributeError, RuntimeError):
        return False


def native_cpu_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (else bf16 GEMMs are emulated, slowly)."""
    cpu = torch.cpu
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        check = getattr(cpu, probe, None)
        if check is not None and check():
            return True
    return False


# From this many rows up, ``F.linear`` on the plain fp32 weight beats the prepacked oneDNN GEMM
# (its per-call repack is amortised and its kernel is faster on tall inputs): SmolLM2-135M's four
# layer GEMMs on a 2-core AVX2 EPYC, GFLOPS packed / plain: 64 rows 133 / 122, 256 rows 157 / 156,
# 1024 rows 161 / 170, 1672 rows 163 / 180.
PLAIN_GEMM_MIN_ROWS = 256


class PrepackedLinear:
    """``y = x @ weight.T + bias`` in fp32 from a weight packed once; output in ``out_dtype``.

    Prompt-sized inputs (``PLAIN_GEMM_MIN_ROWS`` rows and more) use ``F.linear`` on the weight
    itself where keeping it costs nothing (an fp32 weight is not copied)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype, batch_hint: int = 64):
        w32 = weight.detach().float().contiguous()
        self.out_dtype = out_dtype
        self.out_features = w32.shape[0]
        self.bias = None if bias is None else bias.detach().float().contiguous()
        if onednn_linear_available():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w32, batch_hint)
            self.weight = w32 if w32.data_ptr() == weight.data_ptr() else None
        else:
            self.packed = None
            self.weight = w32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        y = self.fp32(x.float())
        return y if y.dtype == self.out_dtype else y.to(self.out_dtype)

    def fp32(self, x32: torch.Tensor) -> torch.Tensor:  # [T, in] fp32 -> [T, out] fp32
        """The product before rounding to ``out_dtype`` (a LoRA delta is added here first)."""
        x32 = x32.contiguous()
        if self.packed is not None and (self.weight is None or x32.shape[0] < PLAIN_GEMM_MIN_ROWS):
            return torch.ops.mkldnn._linear_pointwise(x32, self.packed, self.bias, "none", [], "")
        return F.linear(x32, self.weight, self.bias)


def use_prepacked_linears(device: torch.device | str, dtype: torch.dtype) -> bool:
    """The policy: CPU fp32 when oneDNN is there; CPU bf16 when the CPU lacks native bf16."""
    if torch.device(device).type != "cpu":
        return False
    if dtype == torch.float32:
        return onednn_linear_available()
    return dtype == torch.bfloat16 and not native_cpu_bf16()
