"""An adapter's expert LoRA laid out per sparse layer for the slot pool (host copy).

Per layer, three slices, ``gate`` and ``up`` (of the experts' ``gate_up``) and ``down``, each::

    a       [E, r, in]    expert e's lora_A (zero rows past its own rank, zero for an expert
    b       [E, out, r]   without LoRA)
    scaling [E] fp32      0 for an expert without LoRA

with ``r`` the largest rank of that slice over the experts. PEFT's fused form has one A for gate
and up: both slices hold views of it (and of the two halves of its B), so nothing is copied twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.lora.expert_format import ExpertModuleLoRA
from loraplex.lora.spec import ExpertShapes

PARTS = ("gate", "up", "down")


@dataclass
class ExpertSliceLoRA:
    """One slice (gate, up or down) of every expert of one layer (module doc)."""

    a: torch.Tensor  # [E, r, in]
    b: torch.Tensor  # [E, out, r]
    scaling: torch.Tensor  # [E] fp32

    @property
    def rank(self) -> int:
        return self.a.shape[1]


def fused_factors(a: torch.Tensor, b: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT ``ParamWrapper``'s ``lora_A [r*E, in]`` / ``lora_B [out, r*E]`` as per-expert
    ``A [E, r, in]`` and ``B [E, out, r]`` (its ``get_delta_factors``: A's rows expert-major,
    B's columns rank-major)."""
    rank = a.shape[0] // num_experts
    a_e = a.reshape(num_experts, rank, a.shape[1])
    b_e = b.reshape(b.shape[0], rank, num_experts).permute(2, 0, 1)
    return a_e, b_e.contiguous()


def build_expert_layers(
    modules: dict[tuple[int, str, int], ExpertModuleLoRA],
    tensor,  # (name) -> the tensor in the engine's dtype
    experts: ExpertShapes,
) -> dict[int, dict[str, ExpertSliceLoRA]]:
    """``layer -> {part: ExpertSliceLoRA}`` for the parts an adapter adapts in that layer."""
    num = experts.num_experts
    out: dict[int, dict[str, ExpertSliceLoRA]] = {}
    for (layer, part, expert), m in modules.items():
        if expert >= 0:
            continue
        a, b = fused_factors(tensor(m.a_name), tensor(m.b_name), num)  # [E, r, in], [E, out, r]
        scaling = torch.full((num,), m.scaling, dtype=torch.float32)
        if part == "down":
            out.setdefault(layer, {})["down"] = ExpertSliceLoRA(a, b, scaling)
        else:
            inter = experts.inter
            out.setdefault(layer, {})["gate"] = ExpertSliceLoRA(a, b[:, :inter], scaling)
            out.setdefault(layer, {})["up"] = ExpertSliceLoRA(a, b[:, inter:], scaling)
    per_expert: dict[tuple[int, str], list[ExpertModuleLoRA]] = {}
    for (layer, part, expert), m in modules.items():
        if expert >= 0:
            per_expert.setdefault((layer, part), []).append(m)
    for (layer, part), ms in per_expert.items():
        rank = max(m.rank for m in ms)
        in_f, out_f = experts.part_shape(part)
        first = tensor(ms[0].a_name)
        a = torch.zeros(num, rank, in_f, dtype=first.dtype)
        b = torch.zeros(num, out_f, rank, dtype=first.dtype)
        scaling = torch.zeros(num, dtype=torch.float32)
        for m in ms:
            a[m.expert, : m.rank] = tensor(m.a_name)
            b[m.expert, :, : m.rank] = tensor(m.b_name)
            scaling[m.expert] = m.scaling
        out.setdefault(layer, {})[part] = ExpertSliceLoRA(a, b, scaling)
    return dict(sorted(out.items()))


def expert_host_nbytes(modules: dict[tuple[int, str, int], ExpertModuleLoRA], experts: ExpertShapes,
                       element_size: int) -> int:
    """Bytes ``build_expert_layers`` holds for ``modules`` (A of the fused gate_up once)."""
    num, h, i = experts.num_experts, experts.hidden, experts.inter
    total = 0
    ranks: dict[tuple[int, str], int] = {}
    for (layer, part, expert), m in modules.items():
        if expert < 0:
            total += m.rank * num * (h + 2 * i if part == "gate_up" else i + h)
        else:
            ranks[layer, part] = max(ranks.get((layer, part), 0), m.rank)
    total += sum(r * num * sum(experts.part_shape(part)) for (_, part), r in ranks.items())
    return total * element_size


def max_expert_nbytes(experts: ExpertShapes | None, rank: int, element_size: int) -> int:
    """Bytes of one slot's expert stacks (and of the largest expert adapter's host copy): rank
    ``rank`` on gate, up and down of every expert of every sparse layer; 0 when not enabled."""
    if experts is None or not experts.enabled:
        return 0
    per_layer = experts.num_experts * rank * 3 * (experts.hidden + experts.inter)
    return len(experts.layers) * per_layer * element_size
