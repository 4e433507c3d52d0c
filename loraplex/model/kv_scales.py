"""Calibrated fp8 KV-cache scales in a checkpoint: one ``k_scale`` and one ``v_scale`` per layer.

llm-compressor / compressed-tensors (a ``kv_cache_scheme``) and NVIDIA ModelOpt store, per
attention layer, the number its keys and values are divided by before the fp8 cast (typically
amax / 448 over a calibration set); reads multiply it back (``kernels.kv_quant``). Without it an
fp8 cache uses 1.0, and K/V beyond the format's range saturate. The names vLLM reads
(``weight_utils.maybe_remap_kv_scale_name`` and the quantization configs' ``get_cache_scale``),
under ``layers.{i}.self_attn.``:

* ``k_scale`` / ``v_scale`` (llm-compressor, compressed-tensors);
* ``k_proj.k_scale`` / ``v_proj.v_scale`` (ModelOpt), ``qkv_proj.k_scale`` / ``qkv_proj.v_scale``;
* ``k_proj.output_scale`` / ``v_proj.output_scale`` (older compressed-tensors checkpoints);
* ``kv_scale`` (deprecated in vLLM: one scale for both).

The rules are vLLM's (``BaseKVCacheMethod.process_weights_after_loading``): a layer with both
scales uses each; with only one (or ``kv_scale``), that one for K and V; with none, 1.0. With
``kv_cache_dtype`` auto (or vLLM's ``bfloat16`` / ``float16``, the model's dtype) the scales are
not applied (vLLM scales only an fp8 cache's writes and reads): the cache keeps the model's dtype
and the start-up log says they were read past. Per-tensor scales only (vLLM's
``"Only support per-tensor scaling factor for fp8 KV cache"``): a scale of more than one element
(compressed-tensors' ``attn_head`` strategy) is refused, and so is one that is not a finite
positive number, naming the tensor: vLLM would take a negative one for "absent", but a
checkpoint that stores one is broken, and serving it would divide every K/V by it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from loraplex.model.config import UnsupportedModelError

# per role, the names (after ``layers.{i}.self_attn.``) a checkpoint may store the scale under
K_NAMES = ("k_scale", "k_proj.k_scale", "qkv_proj.k_scale", "k_proj.output_scale")
V_NAMES = ("v_scale", "v_proj.v_scale", "qkv_proj.v_scale", "v_proj.output_scale")
BOTH_NAME = "kv_scale"


class KVScaleError(UnsupportedModelError):
    """A checkpoint's KV-cache scale loraplex cannot apply (the message names the tensor)."""


def _scale_value(name: str, tensor: torch.Tensor) -> float:
    if tensor.numel() != 1:
        raise KVScaleError(
            f"KV-cache scale {name!r} has shape {list(tensor.shape)}: only one scale per layer for K and one "
            "for V (per-tensor) is applied; per-head scales (compressed-tensors' attn_head strategy) are not "
            "served. Serve with --kv-cache-dtype auto, or calibrate per tensor"
        )
    value = float(tensor.reshape(()).float())
    if not math.isfinite(value) or value <= 0.0:
        raise KVScaleError(
            f"KV-cache scale {name!r} is {value}: a scale must be a finite positive number (K/V are stored "
            "divided by it); the checkpoint is damaged. Serve with --kv-cache-dtype auto to leave the scales out"
        )
    return value


def _take_one(raw: dict[str, torch.Tensor], prefix: str, names: tuple[str, ...]) -> tuple[str, torch.Tensor] | None:
    """The one tensor of ``names`` under ``prefix`` (popped), None without one; two are refused."""
    found = [prefix + n for n in names if prefix + n in raw]
    if len(found) > 1:
        raise KVScaleError(f"the checkpoint stores two KV-cache scales for one role: {found[0]!r} and {found[1]!r}")
    return (found[0], raw.pop(found[0])) if found else None


def take_kv_scales(
    raw: dict[str, torch.Tensor], num_layers: int, layer_prefix: Callable[[int], str], apply: bool
) -> tuple[list[tuple[float, float]] | None, list[str]]:
    """``(per-layer (k_scale, v_scale) or None, names read)``: every scale tensor of the ``num_layers``
    attention layers popped from ``raw`` (``layer_prefix(i)``: e.g. ``"layers.3.self_attn."``).
    ``apply`` (an fp8 cache): the scales, checked, 1.0 where a layer has none; None when the
    checkpoint has none at all. Not ``apply``: None, the tensors only read past."""
    names: list[str] = []
    scales: list[tuple[float, float]] = []
    for i in range(num_layers):
        prefix = layer_prefix(i)
        if not apply:  # read past, whatever they hold
            names += [prefix + n for n in (*K_NAMES, *V_NAMES, BOTH_NAME) if raw.pop(prefix + n, None) is not None]
            continue
        k, v = _take_one(raw, prefix, K_NAMES), _take_one(raw, prefix, V_NAMES)
        both = _take_one(raw, prefix, (BOTH_NAME,))
        found = [t for t in (k, v, both) if t is not None]
        names += [name for name, _ in found]
        values = {name: _scale_value(name, tensor) for name, tensor in found}
        if both is not None and (k is not None or v is not None):
            raise KVScaleError(f"the checkpoint stores {both[0]!r} beside {(k or v)[0]!r}: one or the other")
        if both is not None:
            k, v = both, both
        # vLLM: a layer with one of the two uses it for both; with neither, 1.0
        k, v = k or v, v or k
        scales.append((values[k[0]], values[v[0]]) if k is not None else (1.0, 1.0))
    if not apply or not names:
        return None, names
    return scales, names


def describe_kv_scales(scales: list[tuple[float, float]] | None, names: list[str], kv_cache_dtype: str) -> str:
    """The start-up line on the KV cache's scales (whether calibrated ones are in use)."""
    if not kv_cache_dtype.startswith("fp8"):  # auto, or the model's own 16-bit dtype
        if not names:
            return f"KV-cache scales: none (kv_cache_dtype {kv_cache_dtype}: K/V in the model's dtype)"
        return (f"KV-cache scales: the checkpoint's {len(names)} calibrated scale tensors (e.g. {names[0]}) are not "
                f"used: kv_cache_dtype {kv_cache_dtype} keeps K/V in the model's dtype (as vLLM, which applies them "
                "only to an fp8 cache); --kv-cache-dtype fp8 uses them")
    if scales is None:
        return (f"KV-cache scales: not calibrated, 1.0 on every layer (kv_cache_dtype {kv_cache_dtype}); the "
                "checkpoint has no k_scale / v_scale, so K/V beyond the format's range saturate")
    calibrated = sum(1 for s in scales if s != (1.0, 1.0))
    ks, vs = [k for k, _ in scales], [v for _, v in scales]
    return (f"KV-cache scales: calibrated, from the checkpoint ({len(names)} tensors, {calibrated} of {len(scales)} "
            f"layers not 1.0; k_scale {min(ks):.4g}..{max(ks):.4g}, v_scale {min(vs):.4g}..{max(vs):.4g}; "
            f"kv_cache_dtype {kv_cache_dtype})")
