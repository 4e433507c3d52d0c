"""Which quantized checkpoints are served: FP8 weights, read from the ``quantization_config``.

Two formats store fp8 (``float8_e4m3fn``) weights with fp32/bf16 scales beside them; both are
served W8A16 (``fp8_weights``): the weight stays one byte, it is dequantized to the compute dtype
at each matmul, and activations are never quantized.

* ``quant_method: "fp8"`` (transformers' ``FineGrainedFP8Config``, vLLM's ``Fp8Config``):
  with ``weight_block_size`` [rows, cols] each weight has ``weight_scale_inv`` with one scale per
  block (Qwen3-*-FP8, DeepSeek-V3); without it, ``weight_scale`` with one scale per tensor
  (AutoFP8 / vLLM-style checkpoints). ``activation_scheme``: "dynamic" or "static"; a static
  scheme's ``input_scale`` tensors are read past and not applied (activations stay in the
  compute dtype, which is what W8A16 means). ``ignored_layers`` / ``modules_to_not_convert``
  name modules stored unquantized; the loader tells them apart by their stored dtype anyway.
* ``quant_method: "compressed-tensors"`` with ``format: "float-quantized"`` (llm-compressor's
  FP8 / FP8-dynamic / FP8-block, RedHatAI and neuralmagic checkpoints): every config group's
  ``weights`` are ``{num_bits: 8, type: float, symmetric: true}`` with ``strategy`` "tensor"
  (``weight_scale`` [1]), "channel" (``weight_scale`` [out, 1]) or "block" (``block_structure``
  [rows, cols]); ``ignore`` (typically ``lm_head``) lists modules left unquantized.

vLLM's ``quantization="fp8"`` (``LLM(quantization=...)``, ``--quantization fp8``) on an
unquantized checkpoint: its projections are quantized to fp8 at load, one scale per output row
(``QUANTIZE_AT_LOAD``), then served the same way. On an FP8 checkpoint it changes nothing.

Everything else with a ``quantization_config`` (GPTQ, AWQ, bitsandbytes, integer or 4-bit
compressed-tensors, sparse formats) is refused naming the method: loading would cast stored
integers as if they were weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraplex.config import check_quantization

FP8_METHOD = "fp8"
COMPRESSED_TENSORS = "compressed-tensors"
ACTIVATION_SCHEMES = ("dynamic", "static")
CHANNEL_STRATEGIES = ("tensor", "channel", "block")


class QuantizationRefused(ValueError):
    """The checkpoint's quantization is not one loraplex serves (the message names the method)."""


@dataclass(frozen=True)
class Fp8WeightFormat:
    """How an FP8 checkpoint stores its weights; which modules are quantized is read off the
    tensors (an fp8 ``weight`` with a scale beside it)."""

    method: str  # "fp8" | "compressed-tensors"
    strategy: str  # "tensor" | "channel" | "block" (compressed-tensors' names)
    block_size: tuple[int, int] | None = None  # (rows, cols) one block scale covers; strategy "block"
    activation_scheme: str = "dynamic"  # "static": the checkpoint's input_scale tensors are not applied
    ignore: tuple[str, ...] = ()  # modules the config says are left unquantized (lm_head, ...)

    def describe(self) -> str:
        scales = f"{self.block_size[0]}x{self.block_size[1]} block" if self.block_size else f"per-{self.strategy}"
        return f"fp8 e4m3 ({self.method}, {scales} scales)"


# an unquantized checkpoint quantized by the loader (fp8_weights.quantize_per_channel)
QUANTIZE_AT_LOAD = Fp8WeightFormat("quantized at load", "channel")


def _refuse(method: Any, why: str) -> QuantizationRefused:
    return QuantizationRefused(
        f"the checkpoint's weights are quantized (quantization_config.quant_method={method!r}): {why}; "
        "loraplex serves fp8 weights (quant_method 'fp8', or 'compressed-tensors' with float-quantized "
        "8-bit weights) and unquantized bfloat16/float16/float32 ones: serve the unquantized or an FP8 "
        "checkpoint (KV memory can be halved with --kv-cache-dtype fp8)"
    )


def _block_size(value: Any, method: str, key: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise _refuse(method, f"{key} must be two positive integers [rows, cols], got {value!r}")
    return int(value[0]), int(value[1])


def _fp8_method(quant: dict[str, Any]) -> Fp8WeightFormat:
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme not in ACTIVATION_SCHEMES:
        raise _refuse(FP8_METHOD, f"activation_scheme {scheme!r} is not one of {ACTIVATION_SCHEMES}")
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":  # vLLM's Fp8Config: e4m3 only
        raise _refuse(FP8_METHOD, f"fmt {fmt!r}: only e4m3 fp8 weights are served")
    ignore = tuple(quant.get("ignored_layers") or ()) + tuple(quant.get("modules_to_not_convert") or ())
    block = quant.get("weight_block_size")
    if block is None:
        return Fp8WeightFormat(FP8_METHOD, "tensor", None, scheme, ignore)
    return Fp8WeightFormat(FP8_METHOD, "block", _block_size(block, FP8_METHOD, "weight_block_size"), scheme, ignore)


def _compressed_tensors(quant: dict[str, Any]) -> Fp8WeightFormat:
    method = COMPRESSED_TENSORS
    fmt = quant.get("format")
    sparsity = quant.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise _refuse(method, f"sparse weights (sparsity_config.format={sparsity.get('format')!r}) are not served")
    if quant.get("transform_config"):
        raise _refuse(method, "rotated weights (transform_config) are not served")
    groups = quant.get("config_groups") or {}
    if not groups:
        raise _refuse(method, "no config_groups say how the weights are stored")
    strategies: set[tuple[str, tuple[int, int] | None]] = set()
    static = False
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        group_format = group.get("format") or fmt
        if group_format != "float-quantized":
            raise _refuse(method, f"config group {name!r} has format {group_format!r}, not 'float-quantized'")
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise _refuse(method, f"config group {name!r} stores {weights.get('num_bits')}-bit "
                                  f"{weights.get('type')} weights, not 8-bit float")
        if not weights.get("symmetric", True) or weights.get("dynamic", False):
            raise _refuse(method, f"config group {name!r}: only symmetric, statically scaled fp8 weights")
        strategy = weights.get("strategy", "tensor")
        if strategy not in CHANNEL_STRATEGIES:
            raise _refuse(method, f"config group {name!r}: weight strategy {strategy!r} is not one of "
                                  f"{CHANNEL_STRATEGIES}")
        block = _block_size(weights.get("block_structure"), method, "block_structure") if strategy == "block" else None
        strategies.add((strategy, block))
        activations = group.get("input_activations") or {}
        static = static or (bool(activations) and not activations.get("dynamic", False))
    if len(strategies) > 1:
        raise _refuse(method, f"config groups mix weight strategies {sorted(map(str, strategies))}")
    (strategy, block), = strategies
    return Fp8WeightFormat(method, strategy, block, "static" if static else "dynamic", tuple(quant.get("ignore") or ()))


def fp8_weight_format(cfg: dict[str, Any], quantization: str | None = None) -> Fp8WeightFormat | None:
    """The FP8 weight format of a ``config.json`` (with vLLM's ``quantization`` option: "fp8"
    quantizes an unquantized checkpoint at load); None when the weights are served unquantized.
    Raises ``QuantizationRefused`` for any other quantization."""
    check_quantization(quantization)
    quant = cfg.get("quantization_config")
    if not quant or _kv_cache_only(quant):
        return QUANTIZE_AT_LOAD if quantization == "fp8" else None
    method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
    if method == FP8_METHOD:
        return _fp8_method(quant)
    if method == COMPRESSED_TENSORS:
        return _compressed_tensors(quant)
    raise _refuse(method, "only fp8 weights are read, and casting stored integers as weights would give garbage")


def _kv_cache_only(quant: Any) -> bool:
    """Whether a ``quantization_config`` quantizes the KV cache alone: compressed-tensors writes one
    for a recipe with only a ``kv_cache_scheme`` (compressed-tensors#135, transformers#33874), and
    the weights stay plain (vLLM serves such a checkpoint; its k_scale / v_scale tensors are what an
    fp8 KV cache applies, ``kv_scales``). It is that when no config group targets modules with a scheme."""
    if not isinstance(quant, dict) or quant.get("quant_method") != "compressed-tensors":
        return False
    groups = quant.get("config_groups") or {}
    if not quant.get("kv_cache_scheme") or not isinstance(groups, dict):
        return False
    schemes = ("weights", "input_activations", "output_activations")
    return not any(
        not isinstance(g, dict) or (g.get("targets") and any(g.get(k) for k in schemes)) for g in groups.values()
    )
