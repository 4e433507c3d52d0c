"""Device slot buffers for LoRA on ``embed_tokens`` and ``lm_head``, beside the layers' stacks
in ``SlotPool`` and indexed by the same slots.

Each target's buffers are allocated when the first adapter targeting it is written to a slot,
for all ``max_loras`` slots at once (a slot index must address every stack), so an engine whose
adapters never target them holds none of these vocabulary-sized buffers. Per target::

    embed_tokens: a_t [max_loras, vocab, r_max]      A transposed, so a token's row is one gather
                  b   [max_loras, hidden, r_max]
    lm_head:      a   [1, max_loras, r_max, hidden]  the layers' [num_slices, ...] layout, so the
                  b   [max_loras, vocab, r_max]      SGMV shrink/expand kernels take it as is
    scaling [1, max_loras] fp32 and rank [max_loras] int32 (0 where the slot's adapter does not
    target it: the Triton kernels then read nothing of that slot)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.lora.spec import VOCAB_TARGETS, LoRATargetSpec
from loraplex.lora.weights import AdapterWeights
from loraplex.lora.vocab_names import EMBED


@dataclass
class VocabStack:
    """One vocabulary target's stacked buffers (see module doc)."""

    a: torch.Tensor  # embed_tokens: [max_loras, vocab, r_max] (A.T); lm_head: [1, max_loras, r_max, hidden]
    b: torch.Tensor  # embed_tokens: [max_loras, hidden, r_max]; lm_head: [max_loras, vocab, r_max]
    scaling: torch.Tensor  # [1, max_loras] fp32
    rank: torch.Tensor  # [max_loras] int32
    active: list[bool]  # per slot: the adapter there targets this module

    @property
    def out_features(self) -> int:
        return self.b.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, self.b, self.scaling, self.rank))


class VocabStacks:
    """The vocabulary targets' stacks of one slot pool, allocated on first use (module doc)."""

    def __init__(self, spec: LoRATargetSpec, max_loras: int, max_rank: int, device: torch.device, dtype: torch.dtype):
        self.spec = spec
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        self.stacks: dict[str, VocabStack] = {}

    def get(self, module: str) -> VocabStack | None:
        return self.stacks.get(module)

    @property
    def nbytes(self) -> int:
        return sum(st.nbytes for st in self.stacks.values())

    def allocate(self, module: str) -> VocabStack:
        vocab, hidden = self.spec.vocab_size, self.spec.hidden_size
        n, r, kw = self.max_loras, self.max_rank, dict(dtype=self.dtype, device=self.device)
        if module == EMBED:
            a, b = torch.zeros(n, vocab, r, **kw), torch.zeros(n, hidden, r, **kw)
        else:
            a, b = torch.zeros(1, n, r, hidden, **kw), torch.zeros(n, vocab, r, **kw)
        stack = VocabStack(
            a=a,
            b=b,
            scaling=torch.zeros(1, n, dtype=torch.float32, device=self.device),
            rank=torch.zeros(n, dtype=torch.int32, device=self.device),
            active=[False] * n,
        )
        self.stacks[module] = stack
        return stack

    def write(self, slot: int, weights: AdapterWeights) -> None:
        """Fill ``slot``'s rows of every allocated stack from ``weights`` (zero where it does
        not target the module), allocating the stacks ``weights`` needs."""
        for module in VOCAB_TARGETS:
            lora = weights.vocab.get(module)
            stack = self.stacks.get(module)
            if stack is None:
                if lora is None:
                    continue
                stack = self.allocate(module)
            if module == EMBED:
                stack.a[slot].zero_()
            else:
                stack.a[:, slot].zero_()
            stack.b[slot].zero_()
            if lora is None:
                stack.scaling[0, slot] = 0.0
                stack.rank[slot] = 0
                stack.active[slot] = False
                continue
            r = lora.rank
            if module == EMBED:
                stack.a[slot, :, :r].copy_(lora.a.t())  # [vocab, r]
            else:
                stack.a[0, slot, :r].copy_(lora.a)  # [r, hidden]
            stack.b[slot, :, :r].copy_(lora.b)  # [out, r]
            stack.scaling[0, slot] = lora.scaling
            stack.rank[slot] = r
            stack.active[slot] = True

    def clear(self, slot: int) -> None:
        """Take ``slot`` out of every stack (rank 0: no kernel reads it; zeroed on next write)."""
        for stack in self.stacks.values():
            stack.rank[slot] = 0
            stack.active[slot] = False
