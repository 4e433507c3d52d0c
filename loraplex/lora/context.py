"""One step's LoRA state: the batch metadata (DESIGN.md "LoRA batch metadata") and the calls the
model makes around each base projection, after the embedding lookup and after the LM head."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from loraplex.host_arrays import to_tensor
from loraplex.kernels import dispatch
from loraplex.kernels.lora_meta import LoRABatchMeta
from loraplex.kernels.moe_lora import ExpertLoRA, token_slots_from_meta
from loraplex.lora.shrink_overlap import ShrinkOverlap
from loraplex.lora.slots import SlotPool
from loraplex.lora.vocab_apply import LogitsLoRA, add_embedding_lora
from loraplex.lora.vocab_names import EMBED, LM_HEAD

MAX_SLICES = 3  # qkv_proj


def group_by_slot(token_slots: list[int]) -> tuple[list[int], list[int], list[int], int]:
    """``(perm, seg_starts, seg_slot, max_seg_len)`` of a flat batch whose token ``t`` uses
    device slot ``token_slots[t]`` (``-1`` = base model), as host lists.

    ``perm`` is a stable sort of token indices by slot, base-model tokens first; only the
    segments of real slots are listed, so base-only tokens never enter the LoRA kernels.
    """
    num_tokens = len(token_slots)
    perm = sorted(range(num_tokens), key=token_slots.__getitem__)  # stable
    seg_starts: list[int] = []
    seg_slot: list[int] = []
    prev = None
    for row, tok in enumerate(perm):
        slot = token_slots[tok]
        if slot != prev:
            if slot >= 0:
                seg_starts.append(row)
                seg_slot.append(slot)
            prev = slot
    seg_starts.append(num_tokens)
    # with base tokens first, every listed segment ends where the next begins (or at the end)
    max_seg_len = max((seg_starts[g + 1] - seg_starts[g] for g in range(len(seg_slot))), default=0)
    return perm, seg_starts, seg_slot, max_seg_len


def build_batch_meta(token_slots: list[int], slot_rank: torch.Tensor, slot_rank_host: list[int]) -> LoRABatchMeta:
    """The step's ``LoRABatchMeta``: tokens grouped by device slot (see ``group_by_slot``)."""
    device = slot_rank.device
    perm, seg_starts, seg_slot, max_seg_len = group_by_slot(token_slots)
    max_rank = max((slot_rank_host[s] for s in seg_slot), default=0)
    return LoRABatchMeta(
        token_perm=to_tensor(perm, np.int64, device),
        seg_starts=to_tensor(seg_starts, np.int32, device),
        seg_slot=to_tensor(seg_slot, np.int32, device),
        slot_rank=slot_rank,
        num_tokens=len(token_slots),
        num_segments=len(seg_slot),
        max_seg_len=max_seg_len,
        max_rank=max_rank,
        seg_starts_host=seg_starts,
        seg_slot_host=seg_slot,
        slot_rank_host=list(slot_rank_host),
    )


def vocab_meta(pool: SlotPool, module: str, token_slots: list[int]) -> LoRABatchMeta | None:
    """The metadata of the tokens whose adapter targets vocabulary ``module`` (others count as
    base-model rows, so they enter no kernel), or None when there are none."""
    stack = pool.vocab.get(module)
    if stack is None:
        return None
    slots = [s if s >= 0 and stack.active[s] else -1 for s in token_slots]
    if all(s < 0 for s in slots):
        return None
    return build_batch_meta(slots, pool.slot_rank, pool.slot_rank_host)


def logits_lora(pool: SlotPool, row_slots: list[int]) -> LogitsLoRA | None:
    """The lm_head LoRA of logit rows whose device slots are ``row_slots`` (-1 = base model), or
    None when no row's adapter targets lm_head."""
    meta = vocab_meta(pool, LM_HEAD, row_slots)
    return None if meta is None else LogitsLoRA(pool.vocab.get(LM_HEAD), meta, pool.max_rank)


class LoRAStepContext:
    """Built by ``LoRAManager.step_context`` for one step; the model calls ``apply`` after each
    packed projection. Holds the step's metadata and, on CUDA, one fp32 shrink buffer reused by every call."""

    def __init__(
        self,
        pool: SlotPool,
        meta: LoRABatchMeta,
        *,
        shrunk: torch.Tensor | None = None,  # [max_partials, MAX_SLICES, num_tokens, r_max] fp32, e.g. a graph's
        every_projection: bool = False,  # True under a CUDA graph: which kernels run is fixed
        token_slots: list[int] | None = None,  # [num_tokens] each token's slot (-1 = base); eager steps
        overlap: ShrinkOverlap | None = None,  # CUDA: each shrink on a side stream beside its base matmul
    ):
        self.pool = pool
        self.meta = meta
        self.token_slots = token_slots
        self.slots = sorted(set(meta.seg_slot_host))
        self.every_projection = every_projection
        self.overlap = overlap
        # [max_partials, MAX_SLICES, num_tokens, r_max] fp32: shrink output, sliced per
        # projection; only the Triton kernels pass it between shrink and expand (the CPU path is fused)
        self._shrunk = shrunk
        if shrunk is None:
            self._shrunk = dispatch.lora_shrink_scratch(pool.slot_rank, meta.num_tokens, pool.max_rank, MAX_SLICES)

    def apply(self, layer_idx: int, module: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y[t] += sum_s scaling * (x[t] @ A_s.T) @ B_s.T`` for each token's adapter, in place.

        ``module`` is a packed projection name (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
        ``down_proj``); ``x [num_tokens, in]``, ``y [num_tokens, out_total]`` (all slices).
        """
        stack = self._stack(layer_idx, module)
        if stack is not None:
            self._apply_stack(stack, x, y)

    def _apply_stack(self, stack, x: torch.Tensor, y: torch.Tensor) -> None:
        dispatch.lora_apply(
            x, stack.a, stack.b, stack.scaling, stack.slice_offsets, self.meta, y, self._shrunk_for(stack),
            slot_rank=stack.rank,
        )

    def project(self, layer_idx: int, module: str, x: torch.Tensor, base: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``base()`` (the projection's base output ``[num_tokens, out_total]`` from ``x``) plus the
        delta ``apply`` adds. With ``overlap`` (a ``ShrinkOverlap``, CUDA only) the shrink runs on
        its side stream while ``base`` runs, and the expand after both."""
        stack = self._stack(layer_idx, module)
        if stack is None:
            return base()
        if self.overlap is None or self._shrunk is None:
            y = base()
            self._apply_stack(stack, x, y)  # (found above: apply would look it up again)
            return y
        meta, shrunk = self.meta, self._shrunk_for(stack)
        y, result = self.overlap.run(lambda: dispatch.lora_shrink(x, stack.a, meta, shrunk, slot_rank=stack.rank), base)
        dispatch.lora_expand(result, stack.b, stack.scaling, stack.slice_offsets, meta, y, slot_rank=stack.rank)
        return y

    def _stack(self, layer_idx: int, module: str):
        """Layer ``layer_idx``'s slot stack of ``module``, or None when the step adds nothing to it."""
        stack = self.pool.stacks[layer_idx].get(module)
        if stack is None:
            return None
        if not self.every_projection and not any(stack.active[s] for s in self.slots):
            return None  # no adapter of this step touches this projection in this layer
        return stack

    def _shrunk_for(self, stack) -> torch.Tensor | None:  # [max_partials, num_slices, T, r_max] fp32
        return None if self._shrunk is None else self._shrunk[:, : stack.a.shape[0]]

    def expert_lora(self, layer_idx: int) -> ExpertLoRA | None:
        """The LoRA on the experts of sparse layer ``layer_idx`` for this step's tokens, or None when
        the pool holds none or (eager steps) no adapter of the step has any. Under a CUDA graph
        (``every_projection``) it is there whenever the stacks are, for whatever adapters replay."""
        experts = self.pool.experts
        if experts is None or not experts.allocated or layer_idx not in experts.layers:
            return None
        if not self.every_projection and not any(experts.active[s] for s in self.slots):
            return None
        # a few device ops on [num_tokens] per layer, beside the layer's experts; a graph captures
        # them with the layer (kept per call: a context replayed with new metadata stays right)
        meta = self.meta
        token_slot = token_slots_from_meta(meta.token_perm, meta.seg_starts, meta.seg_slot, experts.slot_active)
        st = experts.layers[layer_idx]
        return ExpertLoRA(token_slot, st.a_gate_up, st.b_gate_up, st.scaling_gate_up,
                          st.a_down, st.b_down, st.scaling_down, experts.slot_rank)

    def apply_embedding(self, input_ids: torch.Tensor, hidden: torch.Tensor, scale: float = 1.0) -> None:
        """Add the embed_tokens LoRA delta to the embedding output ``hidden [num_tokens, hidden]``
        (``input_ids [num_tokens]``); ``scale``: see ``vocab_apply.add_embedding_lora``."""
        stack = self.pool.vocab.get(EMBED)
        if stack is None:
            return
        if self.every_projection or self.token_slots is None:
            meta = self.meta  # a graph's static metadata: slots without embed_tokens have rank 0
        else:
            meta = vocab_meta(self.pool, EMBED, self.token_slots)
            if meta is None:
                return
        if self._shrunk is not None:
            shrunk = self._shrunk[0, :1]  # free: the embedding runs before every projection
        else:
            shrunk = torch.empty(1, meta.num_tokens, self.pool.max_rank, dtype=torch.float32, device=hidden.device)
        add_embedding_lora(stack, meta, input_ids, hidden, scale, shrunk)

    def logits_lora(self, rows: list[int]) -> LogitsLoRA | None:
        """The lm_head LoRA for logits computed from the flat batch's rows ``rows``."""
        if self.token_slots is None or self.pool.vocab.get(LM_HEAD) is None:
            return None
        return logits_lora(self.pool, [self.token_slots[r] for r in rows])
