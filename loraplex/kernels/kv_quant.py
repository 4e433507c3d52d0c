"""The KV cache's storage dtype: the model's (``"auto"``, or vLLM's ``bfloat16`` / ``float16``
where that is the model's dtype), or one byte per element (fp8).

vLLM's ``--kv-cache-dtype fp8`` (= ``fp8_e4m3``) and ``fp8_e5m2``: keys and values are stored as
``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` with one scale per layer for K and one for V: a
checkpoint's calibrated ``k_scale`` / ``v_scale`` (``model.kv_scales``), else 1.0 (what vLLM uses
when a checkpoint brings none). A write stores ``x / scale`` (divided in fp32, as vLLM's cache
write does) rounded to the nearest fp8 value and saturated at the format's largest finite value
(448 for e4m3, 57344 for e5m2), as vLLM's fp8 conversion does, instead of letting an outlier
become inf (torch's e5m2 cast) or relying on the cast's own overflow rule; NaN stays NaN. A read
is ``stored * scale``: every fp8 value is exact in bfloat16, float16 and float32, and the kernels
apply the scale where it costs nothing (K's in the softmax scale, V's in the output's
normalisation), which is the same attention as over the dequantized K/V.

Writes quantize in torch on every path (CPU and CUDA), so one rounding rule holds everywhere;
the Triton write kernel then copies bytes. A scale of 1.0 skips the division (x / 1.0 is x).
"""

from __future__ import annotations

import torch

FP8_KV_DTYPES = {
    "fp8": torch.float8_e4m3fn,  # vLLM's "fp8" is e4m3
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


# vLLM's names for a cache in a 16-bit float dtype: taken when that is the model's dtype
MODEL_DTYPE_KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype for ``EngineConfig.kv_cache_dtype`` ``name`` (``"auto"``: ``model_dtype``);
    the name was checked when the config was built (``config.check_kv_cache_dtype``). A 16-bit
    name other than the model's dtype is refused (ValueError): vLLM would store K/V in it whatever
    the model computes in; loraplex's kernels read a cache that is not fp8 in the compute dtype."""
    if name in MODEL_DTYPE_KV_DTYPES:
        if MODEL_DTYPE_KV_DTYPES[name] != model_dtype:
            model = str(model_dtype).removeprefix("torch.")
            raise ValueError(
                f"kv_cache_dtype {name}: the model runs in {model}, and loraplex keeps a KV cache that is "
                f"not fp8 in the model's dtype; give dtype {name} (--dtype {name}) for a {name} cache, or "
                "kv_cache_dtype auto")
        return model_dtype
    return model_dtype if name == "auto" else FP8_KV_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x / scale`` in ``cache_dtype``; into fp8 with saturation at the format's finite maximum.
    The division runs in fp32 (x in bf16 would round twice)."""
    if scale != 1.0:
        x = x.float() / scale
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    limit = torch.finfo(cache_dtype).max
    return x.clamp(-limit, limit).to(cache_dtype)


def dequantize_kv(stored: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Stored K or V back in fp32: ``stored * scale`` (the reference read; kernels fold the scale)."""
    return stored.float() * scale if scale != 1.0 else stored.float()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor's storage as uint8 (same shape): copies and index ops that torch's CPU
    kernels lack for fp8 (``index_copy_``) run on the bytes."""
    return t.view(torch.uint8)


def check_kv_dtype_device(cache_dtype: torch.dtype, device: torch.device) -> None:
    """Refuse (ValueError) an fp8 cache the device's Triton kernels cannot read: Triton's e4m3
    (``fp8e4nv``) needs compute capability 8.9 or later (Ada, Hopper), e5m2 (``fp8e5``) runs on
    every CUDA target (triton/backends/nvidia/compiler.py, ``supported_fp8_dtypes``)."""
    if cache_dtype != torch.float8_e4m3fn or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ValueError(
            f"kv_cache_dtype fp8 / fp8_e4m3 needs a GPU of compute capability 8.9 or later (this one is "
            f"{capability[0]}.{capability[1]}); use fp8_e5m2 or auto"
        )
