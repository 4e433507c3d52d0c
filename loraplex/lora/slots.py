"""Device slot pool: ``max_loras`` adapters resident on the accelerator, stacked per layer and
packed module in the layout ``loraplex.kernels.dispatch`` computes with.

Per layer and packed module (slices as in ``LoRATargetSpec.packed_modules``)::

    a       [num_slices, max_loras, r_max, in]    adapter dtype = engine dtype
    b       [max_loras, out_total, r_max]         slices concatenated along out
    scaling [num_slices, max_loras]               fp32 (per module, so alpha_pattern is exact)

plus ``slot_rank[max_loras]`` (int32, the real rank of each slot; 0 = empty) and, per stack,
``rank[max_loras]`` (the rank of the slot's adapter in that projection; 0 where the adapter does
not adapt it). Rows and columns beyond a module's rank are zero; the Triton kernels read no
weights past the stack's ``rank`` (a projection an adapter leaves alone costs it nothing, also
under a CUDA graph, which runs every projection's kernels).

LoRA on ``embed_tokens`` and ``lm_head`` lives in ``vocab`` (``vocab_slots.VocabStacks``), indexed
by the same slots and allocated only once an adapter targeting them is loaded; so does LoRA on an
MoE model's experts, in ``experts`` (``expert_slots.ExpertStacks``), where the engine serves it.

Eviction is LRU among slots that are neither pinned nor protected by the caller (the adapters
of the step being prepared); slots whose adapter still has requests (``refs``) go last.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.lora.expert_slots import ExpertStacks
from loraplex.lora.spec import LoRATargetSpec
from loraplex.lora.vocab_slots import VocabStacks
from loraplex.lora.weights import AdapterWeights


def slot_pool_dtype(device: torch.device | str, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the slot pool's stacks for an engine of ``dtype`` on ``device``: CPU matmuls on
    small bf16 batches are ~10x slower than fp32 (AVX2), so CPU stacks are fp32 (host copies stay
    in the engine dtype and are converted when a slot is filled)."""
    return torch.float32 if torch.device(device).type == "cpu" else dtype


@dataclass
class LoRAStack:
    """The stacked buffers of one packed projection in one layer (see module doc)."""

    a: torch.Tensor  # [num_slices, max_loras, r_max, in]
    b: torch.Tensor  # [max_loras, out_total, r_max]
    scaling: torch.Tensor  # [num_slices, max_loras] fp32
    slice_offsets: tuple[int, ...]  # num_slices + 1 offsets into out_total
    active: list[bool]  # per slot: the adapter there has weights for this projection
    rank: torch.Tensor  # [max_loras] int32: the adapter's rank in this projection (0 = none)


class SlotPool:
    """``max_loras`` device slots keyed by adapter content hash (see module doc)."""

    def __init__(self, spec: LoRATargetSpec, max_loras: int, max_rank: int, device: torch.device, dtype: torch.dtype):
        self.spec = spec
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = torch.device(device)
        self.dtype = dtype
        # allocated at the first adapter load, so a base-model-only engine holds no LoRA memory
        self.stacks: list[dict[str, LoRAStack]] = []
        self.vocab = VocabStacks(spec, max_loras, max_rank, self.device, dtype)
        served = spec.experts is not None and spec.experts.enabled
        self.experts = ExpertStacks(spec.experts, max_loras, max_rank, self.device, dtype) if served else None
        self.slot_rank = torch.zeros(max_loras, dtype=torch.int32, device=self.device)  # [max_loras]
        self.slot_rank_host = [0] * max_loras
        self.adapter_in: list[str | None] = [None] * max_loras
        self._slot_of: dict[str, int] = {}
        self._last_used = [0] * max_loras
        self._tick = 0
        self.pinned: set[str] = set()
        self.refs: dict[str, int] = {}  # adapter -> requests still needing it (set by the manager)
        # bumped whenever a slot's adapter changes (``write``, ``clear``): a step's slots computed
        # at one generation hold while it stands (``LoRAManager`` reuses them across steps)
        self.generation = 0

    def _allocate(self) -> None:
        spec, max_loras, max_rank, dtype = self.spec, self.max_loras, self.max_rank, self.dtype
        for layer_idx in range(spec.num_layers):
            layer: dict[str, LoRAStack] = {}
            for packed, names in spec.packed_modules.items():
                if not all(spec.module_in_layer(n, layer_idx) for n in names):
                    continue  # not in this model, or not in this layer (an MoE model's sparse MLP)
                in_f = spec.module_shapes[names[0]][0]
                offsets = [0]
                for n in names:
                    offsets.append(offsets[-1] + spec.module_shapes[n][1])
                layer[packed] = LoRAStack(
                    a=torch.zeros(len(names), max_loras, max_rank, in_f, dtype=dtype, device=self.device),
                    b=torch.zeros(max_loras, offsets[-1], max_rank, dtype=dtype, device=self.device),
                    scaling=torch.zeros(len(names), max_loras, dtype=torch.float32, device=self.device),
                    slice_offsets=tuple(offsets),
                    active=[False] * max_loras,
                    rank=torch.zeros(max_loras, dtype=torch.int32, device=self.device),
                )
            self.stacks.append(layer)

    @property
    def nbytes(self) -> int:
        """Bytes of the allocated weight stacks (the vocabulary targets' included)."""
        layers = sum(
            t.numel() * t.element_size() for layer in self.stacks for st in layer.values() for t in (st.a, st.b)
        )
        return layers + self.vocab.nbytes + (self.experts.nbytes if self.experts is not None else 0)

    def allocate_all(self) -> None:
        """Allocate every stack the pool can come to hold (the layers', each vocabulary target's,
        the experts'): the pool at its largest, as the engine reserves it (on ``meta``, nothing)."""
        if not self.stacks:
            self._allocate()
        for module in self.spec.vocab_shapes:
            if self.vocab.get(module) is None:
                self.vocab.allocate(module)
        if self.experts is not None and not self.experts.allocated:
            self.experts.allocate()

    @property
    def allocated_bytes(self) -> int:
        """Bytes of every tensor the pool holds: the weight stacks (``nbytes``) and the fp32
        scalings and int32 ranks beside them."""
        tensors = [self.slot_rank]
        for stack in [*(st for layer in self.stacks for st in layer.values()), *self.vocab.stacks.values()]:
            tensors += [stack.a, stack.b, stack.scaling, stack.rank]
        if self.experts is not None:
            tensors += self.experts.tensors()
        return sum(t.numel() * t.element_size() for t in tensors)

    def slot_of(self, adapter_id: str) -> int | None:
        return self._slot_of.get(adapter_id)

    def resident(self) -> list[str]:
        return [a for a in self.adapter_in if a is not None]

    def touch(self, adapter_ids) -> None:
        self._tick += 1
        for a in adapter_ids:
            slot = self._slot_of.get(a)
            if slot is not None:
                self._last_used[slot] = self._tick

    def free_slot(self) -> int | None:
        return next((i for i, a in enumerate(self.adapter_in) if a is None), None)

    def slot_to_fill(self, protected: set[str], idle_only: bool = False) -> int | None:
        """A free slot, else the ``victim``'s; None when every slot is taken and none may go."""
        slot = self.free_slot()
        return self.victim(protected, idle_only) if slot is None else slot

    def victim(self, protected: set[str], idle_only: bool = False) -> int | None:
        """The slot to evict: not pinned, not protected; idle adapters (no refs) first, then LRU."""
        best, best_key = None, None
        for slot, a in enumerate(self.adapter_in):
            if a is None or a in self.pinned or a in protected:
                continue
            busy = self.refs.get(a, 0) > 0
            if idle_only and busy:
                continue
            key = (busy, self._last_used[slot])
            if best_key is None or key < best_key:
                best, best_key = slot, key
        return best

    def write(self, slot: int, weights: AdapterWeights) -> None:
        """Fill ``slot`` with ``weights`` (clearing what was there)."""
        if weights.rank > self.max_rank:
            raise ValueError(f"adapter rank {weights.rank} exceeds the pool's max rank {self.max_rank}")
        if not self.stacks:
            self._allocate()
        old = self.adapter_in[slot]
        if old is not None:
            self._slot_of.pop(old, None)
        for layer_idx, layer in enumerate(self.stacks):
            for packed, st in layer.items():
                st.a[:, slot].zero_()
                st.b[slot].zero_()
                scales = [0.0] * st.a.shape[0]
                lora = weights.layers.get((layer_idx, packed))
                module_rank = 0
                if lora is not None:
                    for s, sl in enumerate(lora.slices):
                        if sl is None:
                            continue
                        r = sl.rank
                        module_rank = max(module_rank, r)
                        o0, o1 = st.slice_offsets[s], st.slice_offsets[s + 1]
                        st.a[s, slot, :r].copy_(sl.a)  # [r, in]
                        st.b[slot, o0:o1, :r].copy_(sl.b)  # [out_s, r]
                        scales[s] = sl.scaling
                st.scaling[:, slot] = torch.tensor(scales, dtype=torch.float32)
                st.active[slot] = lora is not None
                st.rank[slot] = module_rank
        self.vocab.write(slot, weights)
        if self.experts is not None:
            self.experts.write(slot, weights.experts)
        elif weights.experts:  # validation refuses such adapters on this engine first
            raise ValueError("adapter has expert LoRA, which this slot pool holds no room for")
        self.adapter_in[slot] = weights.adapter_id
        self._slot_of[weights.adapter_id] = slot
        self.generation += 1
        self.slot_rank_host[slot] = weights.rank
        self.slot_rank[slot] = weights.rank
        self._tick += 1
        self._last_used[slot] = self._tick

    def clear(self, slot: int) -> str | None:
        """Empty ``slot``; returns the adapter that was there. Buffers are zeroed on next write
        (rank 0 already keeps compute off them)."""
        old = self.adapter_in[slot]
        if old is None:
            return None
        self._slot_of.pop(old, None)
        self.adapter_in[slot] = None
        self.generation += 1
        self.slot_rank_host[slot] = 0
        self.slot_rank[slot] = 0
        for layer in self.stacks:
            for st in layer.values():
                st.active[slot] = False
                st.rank[slot] = 0
        self.vocab.clear(slot)
        if self.experts is not None:
            self.experts.clear(slot)
        return old
