"""Device slot buffers for LoRA on an MoE model's experts, beside the layers' stacks in
``SlotPool`` and indexed by the same slots; allocated when the first adapter with expert LoRA is
written (the engine's KV budget has counted them already: ``records.max_adapter_host_nbytes``).

Per sparse layer (``L`` = max_loras, ``E`` experts, ``R`` = max rank)::

    a_gate_up       [2, L, E, R, H]   gate's A, then up's (PEFT's fused form: the same A twice)
    b_gate_up       [L, E, 2I, R]     gate's B rows, then up's (transformers' gate_up order)
    scaling_gate_up [2, L, E] fp32
    a_down          [L, E, R, I]
    b_down          [L, E, H, R]
    scaling_down    [L, E] fp32

Rows and columns past an expert's rank are zero, as are an expert without LoRA and a slot whose
adapter has none in that layer (scaling 0 too), so the kernels may run every pair at the full
``R``; ``slot_rank [L]`` (int32, device: the slot's largest expert rank) lets them read no more.
``slot_active [L]`` (int32, device) is 1 where the slot's adapter has expert LoRA: pairs of other
slots are skipped as base-only ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.lora.spec import ExpertShapes


@dataclass
class ExpertLayerStack:
    """One sparse layer's expert LoRA buffers for every slot (module doc)."""

    a_gate_up: torch.Tensor  # [2, L, E, R, H]
    b_gate_up: torch.Tensor  # [L, E, 2I, R]
    scaling_gate_up: torch.Tensor  # [2, L, E] fp32
    a_down: torch.Tensor  # [L, E, R, I]
    b_down: torch.Tensor  # [L, E, H, R]
    scaling_down: torch.Tensor  # [L, E] fp32

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a_gate_up, self.b_gate_up, self.a_down, self.b_down))


class ExpertStacks:
    """The expert LoRA stacks of one slot pool (module doc)."""

    def __init__(self, experts: ExpertShapes, max_loras: int, max_rank: int, device: torch.device, dtype: torch.dtype):
        self.shapes = experts
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        self.layers: dict[int, ExpertLayerStack] = {}
        self.active = [False] * max_loras
        self.slot_active = torch.zeros(max_loras, dtype=torch.int32, device=device)  # [L]
        self.slot_rank = torch.zeros(max_loras, dtype=torch.int32, device=device)  # [L]: largest expert rank

    @property
    def allocated(self) -> bool:
        return bool(self.layers)

    @property
    def nbytes(self) -> int:
        return sum(st.nbytes for st in self.layers.values())

    def allocate(self) -> None:
        e, h, i = self.shapes.num_experts, self.shapes.hidden, self.shapes.inter
        n, r, kw = self.max_loras, self.max_rank, dict(dtype=self.dtype, device=self.device)
        for layer in self.shapes.layers:
            self.layers[layer] = ExpertLayerStack(
                a_gate_up=torch.zeros(2, n, e, r, h, **kw),
                b_gate_up=torch.zeros(n, e, 2 * i, r, **kw),
                scaling_gate_up=torch.zeros(2, n, e, dtype=torch.float32, device=self.device),
                a_down=torch.zeros(n, e, r, i, **kw),
                b_down=torch.zeros(n, e, h, r, **kw),
                scaling_down=torch.zeros(n, e, dtype=torch.float32, device=self.device),
            )

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held: the per-slot flags and ranks, each layer's stacks and scalings."""
        out = [self.slot_active, self.slot_rank]
        for st in self.layers.values():
            out += [st.a_gate_up, st.b_gate_up, st.scaling_gate_up, st.a_down, st.b_down, st.scaling_down]
        return out

    def write(self, slot: int, experts: dict) -> None:
        """Fill ``slot`` from an adapter's ``AdapterWeights.experts`` (``layer -> {part: slice}``;
        empty: the adapter has no expert LoRA), allocating the stacks at the first such adapter."""
        if not experts and not self.layers:
            return
        if not self.layers:
            self.allocate()
        inter = self.shapes.inter
        for layer, st in self.layers.items():
            for t in (st.a_gate_up[:, slot], st.b_gate_up[slot], st.scaling_gate_up[:, slot], st.a_down[slot],
                      st.b_down[slot], st.scaling_down[slot]):
                t.zero_()
            parts = experts.get(layer, {})
            for s, part in enumerate(("gate", "up")):
                lora = parts.get(part)
                if lora is not None:
                    r = lora.rank
                    st.a_gate_up[s, slot, :, :r].copy_(lora.a)  # [E, r, H]
                    st.b_gate_up[slot, :, s * inter:(s + 1) * inter, :r].copy_(lora.b)  # [E, I, r]
                    st.scaling_gate_up[s, slot].copy_(lora.scaling)
            lora = parts.get("down")
            if lora is not None:
                r = lora.rank
                st.a_down[slot, :, :r].copy_(lora.a)  # [E, r, I]
                st.b_down[slot, :, :, :r].copy_(lora.b)  # [E, H, r]
                st.scaling_down[slot].copy_(lora.scaling)
        self.active[slot] = bool(experts)
        self.slot_active[slot] = int(bool(experts))
        self.slot_rank[slot] = max((lora.rank for parts in experts.values() for lora in parts.values()), default=0)

    def clear(self, slot: int) -> None:
        """Take ``slot`` out (its pairs count as base-only; buffers are zeroed on next write)."""
        self.active[slot] = False
        self.slot_active[slot] = 0
