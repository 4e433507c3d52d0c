"""A sparse layer's experts read from a checkpoint and stacked: ``experts_gate_up [E, 2I, H]``
(gate rows then up rows) and ``experts_down [E, H, I]``, plain or fp8.

Layouts: per expert (``{block}experts.{e}.{gate,up,down}.weight``, what published checkpoints
hold, Mixtral's ``w1`` / ``w3`` / ``w2``) and fused (``{block}experts.gate_up_proj`` /
``down_proj``, transformers 5's in-memory layout).

FP8 checkpoints (Qwen3-30B-A3B-FP8: ``weight_scale_inv`` per 128x128 block; llm-compressor
FP8 / FP8-dynamic: ``weight_scale`` per tensor or per output channel) store each expert's
projections fp8 with a scale beside them; they stack into an ``Fp8Weight`` whose ``weight`` is
``[E, rows, cols]`` fp8 and whose ``scale`` is ``[E, rows, groups]`` fp32: the dense path's
per-row layout (``fp8_weights``) with an expert dimension in front, so gate and up keep their own
per-tensor scales inside ``gate_up``. The fused layout's scales are transformers' FineGrainedFP8
experts' (``gate_up_proj_scale_inv`` ``[E, ceil(2I / rows), ceil(H / cols)]`` with blocks; per
tensor ``[E, 1, 1]``, or ``[E, 2, 1]``: one for the gate half and one for the up half).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loraplex.model.fp8_config import Fp8WeightFormat
from loraplex.model.fp8_weights import FP8_DTYPE, Fp8Weight, row_scales, pack_fp8, take_fp8_weight

Take = Callable[[str], torch.Tensor]


def _stack(parts: list[Fp8Weight | None], names: list[str]) -> Fp8Weight | None:
    """Per-expert fp8 weights stacked along a new expert dimension (None: none is fp8)."""
    if all(p is None for p in parts):
        return None
    plain = [n for n, p in zip(names, parts) if p is None]
    if plain:
        raise ValueError(f"experts {plain[:3]} are stored unquantized while the others of their layer are fp8: "
                         "a layer's experts are served all fp8 or not at all")
    return Fp8Weight(torch.stack([p.weight for p in parts]), torch.stack([p.scale for p in parts]))


def _per_expert(raw: dict[str, torch.Tensor], take: Take, block: str, parts: tuple[str, str, str],
                num_experts: int, fmt: Fp8WeightFormat | None) -> tuple[torch.Tensor | Fp8Weight, ...]:
    gate, up, down = parts
    experts = [f"{block}experts.{e}." for e in range(num_experts)]
    if fmt is not None:
        gate_up = _stack([pack_fp8([take_fp8_weight(raw, take, ex + m, fmt) for m in (gate, up)],
                                   [ex + gate, ex + up]) for ex in experts], [ex + gate for ex in experts])
        down_fp8 = _stack([take_fp8_weight(raw, take, ex + down, fmt) for ex in experts],
                          [ex + down for ex in experts])
        if (gate_up is None) != (down_fp8 is None):
            raise ValueError(f"{block}experts: gate/up and down are not both fp8; served all fp8 or not at all")
        if gate_up is not None:
            return gate_up, down_fp8
    gate_up = torch.stack([torch.cat([take(f"{ex}{gate}.weight"), take(f"{ex}{up}.weight")]) for ex in experts])
    return gate_up, torch.stack([take(f"{ex}{down}.weight") for ex in experts])


def _fused_fp8(raw: dict[str, torch.Tensor], take: Take, name: str, fmt: Fp8WeightFormat) -> Fp8Weight:
    """The fused ``name`` ([E, rows, cols] fp8) with its scale in the per-row layout."""
    scale_name = next((f"{name}{s}" for s in ("_scale_inv", "_scale") if f"{name}{s}" in raw), None)
    if scale_name is None:
        raise ValueError(f"{name} is fp8 but the checkpoint has no {name}_scale_inv or {name}_scale for it")
    weight, scale = take(name), take(scale_name).to(torch.float32)
    num_experts, rows = weight.shape[0], weight.shape[1]
    if scale.dim() != 3 or scale.shape[0] != num_experts:
        raise ValueError(f"{scale_name}: shape {tuple(scale.shape)}; expected [{num_experts}, row groups, col groups]")
    if fmt.block_size is None and tuple(scale.shape[1:]) == (2, 1) and rows % 2 == 0:
        # transformers keeps one per-tensor scale for each half of the fused gate_up
        return Fp8Weight(weight, scale.repeat_interleave(rows // 2, dim=1).contiguous())
    if fmt.block_size is None and scale.shape[2] == 1 and scale.shape[1] == 1:
        return Fp8Weight(weight, scale.expand(num_experts, rows, 1).contiguous())
    return Fp8Weight(weight, torch.stack([row_scales(scale[e], weight[e], fmt, f"{name}[{e}]")
                                          for e in range(num_experts)]))


def take_experts(raw: dict[str, torch.Tensor], take: Take, block: str, parts: tuple[str, str, str],
                 num_experts: int, fmt: Fp8WeightFormat | None) -> tuple[torch.Tensor | Fp8Weight, ...]:
    """``(experts_gate_up, experts_down)`` of the sparse block ``block`` ("layers.3.mlp."), each a
    stacked tensor or, where the checkpoint stores the experts fp8, a stacked ``Fp8Weight``."""
    fused = block + "experts.gate_up_proj"
    if fused not in raw:
        return _per_expert(raw, take, block, parts, num_experts, fmt)
    down = block + "experts.down_proj"
    fp8 = [raw[n].dtype == FP8_DTYPE for n in (fused, down)]
    if fmt is None or not any(fp8):
        return take(fused), take(down)
    if not all(fp8):
        raise ValueError(f"{block}experts: gate_up_proj and down_proj are not both fp8")
    return _fused_fp8(raw, take, fused, fmt), _fused_fp8(raw, take, down, fmt)


def stacked_shapes(gate_up: torch.Tensor | Fp8Weight, down: torch.Tensor | Fp8Weight) -> tuple[torch.Size, ...]:
    """The ``[E, 2I, H]`` and ``[E, H, I]`` shapes of the stacked experts, fp8 or not."""
    return tuple((w.weight if isinstance(w, Fp8Weight) else w).shape for w in (gate_up, down))
