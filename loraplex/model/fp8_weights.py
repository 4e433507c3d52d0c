"""FP8 weights served W8A16: read from the checkpoint, packed, and dequantized at each matmul.

A quantized projection keeps its weight as ``float8_e4m3fn`` (one byte per element: the memory
saving) and a scale in fp32 shaped ``[out_features, groups]``: one scale per output row and per
``in_features / groups`` consecutive input columns. Every stored form is put in that shape at
load, so packed projections (qkv, gate_up) concatenate their parts' rows and scales alike:

* per tensor (``weight_scale`` with one element): ``[out, 1]``, the part's scale on each of its
  rows, so q, k and v keep their own scales inside the packed qkv;
* per channel (``[out, 1]`` or ``[out]``): as stored;
* per block (``weight_scale_inv`` / ``weight_scale`` ``[ceil(out / rows), ceil(in / cols)]``):
  each block row repeated over the weight rows it covers, giving ``[out, ceil(in / cols)]``;
  that costs 4 bytes per ``cols`` weights (3% of the fp8 bytes at 128) and packs any part sizes.

``dequantize`` gives the weight in the compute dtype: ``weight.to(dtype) * scale`` per group.
In fp32 that is exact (an fp8 value times an fp32 scale rounds once); in bf16 / fp16 the scale
is rounded to the compute dtype first (exact for the bf16 scales compressed-tensors stores for
bf16 models). No fp8 GEMM (``torch._scaled_mm``, W8A8) is used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.model.fp8_config import Fp8WeightFormat

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")  # transformers' block scales; vLLM / compressed-tensors
# per-module tensors of a quantized checkpoint read past: static activation scales (W8A16 does
# not quantize activations) and compressed-tensors' all-zero symmetric zero points
IGNORED_SUFFIXES = (".input_scale", ".weight_zero_point", ".input_zero_point")


@dataclass
class Fp8Weight:
    """A quantized linear weight: fp8 values and their fp32 scales (see the module docstring)."""

    weight: torch.Tensor  # [out, in] float8_e4m3fn ([E, out, in] for stacked experts)
    scale: torch.Tensor  # [out, groups] float32 ([E, out, groups])

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.scale.numel() * self.scale.element_size()


def row_scales(scale: torch.Tensor, weight: torch.Tensor, fmt: Fp8WeightFormat, name: str) -> torch.Tensor:
    """The stored scale of ``weight`` as ``[out, groups]`` fp32."""
    out, inp = weight.shape
    scale = scale.to(torch.float32)
    if fmt.block_size is not None:
        rows, cols = fmt.block_size
        expected = (-(-out // rows), -(-inp // cols))
        if tuple(scale.shape) != expected:
            raise ValueError(f"{name}: block scale of shape {tuple(scale.shape)} for a [{out}, {inp}] weight in "
                             f"{rows}x{cols} blocks; expected {expected}")
        return scale.repeat_interleave(rows, dim=0)[:out].contiguous()
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(out, 1).contiguous()
    if scale.numel() == out and (scale.dim() == 1 or tuple(scale.shape) == (out, 1)):
        return scale.reshape(out, 1).contiguous()
    raise ValueError(f"{name}: scale of shape {tuple(scale.shape)} is neither per tensor nor per output channel "
                     f"of a [{out}, {inp}] weight ({fmt.describe()})")


def take_fp8_weight(raw: dict[str, torch.Tensor], take, module: str, fmt: Fp8WeightFormat) -> Fp8Weight | None:
    """``module``'s weight as stored fp8 with its scale (``take``n from ``raw``), or None when the
    checkpoint stores that module unquantized (an ``ignore``d one)."""
    weight = raw.get(f"{module}.weight")
    if weight is None or weight.dtype != FP8_DTYPE:
        if weight is not None and weight.dtype.is_floating_point and weight.element_size() == 1:
            raise ValueError(f"{module}.weight is {weight.dtype}: only float8_e4m3fn weights are served")
        return None
    scale_name = next((f"{module}.{s}" for s in SCALE_SUFFIXES if f"{module}.{s}" in raw), None)
    if scale_name is None:
        raise ValueError(f"{module}.weight is fp8 but the checkpoint has no {' or '.join(SCALE_SUFFIXES)} for it")
    weight = take(f"{module}.weight")
    return Fp8Weight(weight, row_scales(take(scale_name), weight, fmt, module))


def pack_fp8(parts: list[Fp8Weight | None], names: list[str]) -> Fp8Weight | None:
    """The parts of a packed projection, concatenated along the output rows (None: none is fp8)."""
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        mixed = [n for n, p in zip(names, parts) if p is None]
        raise ValueError(f"{mixed} stored unquantized while the other parts of their packed projection "
                         f"({names}) are fp8: a packed projection is served all fp8 or not at all")
    groups = {p.scale.shape[1] for p in parts}
    if len(groups) > 1:
        raise ValueError(f"{names}: the parts' scales cover different input groups ({sorted(groups)})")
    return Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]))


def quantize_per_channel(weight: torch.Tensor) -> Fp8Weight:
    """``weight`` [out, in] quantized to fp8 with one scale per output row (its largest magnitude
    maps to the format's largest value; an all-zero row gets scale 1), rounding to nearest."""
    w32 = weight.float()
    amax = w32.abs().amax(dim=-1, keepdim=True)  # [..., out, 1]: stacked experts quantize alike
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return Fp8Weight((w32 / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block_cols: int | None) -> torch.Tensor:
    """``weight`` [..., out, in] fp8 times ``scale`` [..., out, groups] fp32, as [..., out, in]
    ``dtype`` (leading dims: stacked experts); a scale covers ``block_cols`` input columns (the last
    group may be narrower), or all of them when ``groups`` is 1. One temporary of the weight's
    size in ``dtype``: the multiply is in place."""
    *lead, inp = weight.shape
    groups = scale.shape[-1]
    w = weight.to(dtype)
    s = scale.to(dtype)
    if groups == 1:
        return w.mul_(s)
    if block_cols * groups == inp:
        w.view(*lead, groups, block_cols).mul_(s.unsqueeze(-1))
        return w
    return w.mul_(s.repeat_interleave(block_cols, dim=-1)[..., :inp])  # a last block narrower than the others


def take_full_precision(raw: dict[str, torch.Tensor], take, module: str, fmt: Fp8WeightFormat | None) -> torch.Tensor:
    """``module``'s weight in full precision: one stored fp8 outside the projections served fp8 (an
    lm_head or MoE router a checkpoint did not ``ignore``) is dequantized here, in fp32."""
    quantized = None if fmt is None else take_fp8_weight(raw, take, module, fmt)
    if quantized is None:
        return take(f"{module}.weight")
    block_cols = fmt.block_size[1] if fmt.block_size else None
    return dequantize(quantized.weight, quantized.scale, torch.float32, block_cols)
