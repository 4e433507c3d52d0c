"""The LoRA deltas of ``embed_tokens`` and ``lm_head`` (PEFT's ``Embedding`` and ``Linear``
LoRA), on the stacks of ``vocab_slots`` and a step's ``LoRABatchMeta``.

* lm_head is an ordinary linear LoRA with ``out = vocab``: the SGMV shrink/expand (Triton on
  CUDA, the fused torch twin on CPU) add ``scaling * (h @ A.T) @ B.T`` into the fp32 logits.
* embed_tokens: PEFT's ``A [r, vocab]`` is a lookup table, so the "shrink" is a row gather of
  ``A.T`` by token id, done in torch on both paths (one indexing op; a kernel would buy nothing
  for r values per token); the expand is the same SGMV expand as the linears', which adds
  ``scale * scaling * row @ B.T`` into the embedding output.

Both read only device tensors and the meta's host counts, so they run inside a captured CUDA
graph; slots whose adapter does not target the module have rank 0 there and cost nothing.
"""

from __future__ import annotations

import torch

from loraplex.kernels import dispatch
from loraplex.kernels.lora_meta import LoRABatchMeta
from loraplex.lora.vocab_slots import VocabStack


def permuted_row_slots(meta: LoRABatchMeta) -> torch.Tensor:  # [num_tokens] int64
    """The slot of each permuted row's segment, on the device without a host read. Rows outside
    every listed segment (base-model rows) get a valid but meaningless slot: expand skips them."""
    rows = torch.arange(meta.num_tokens, dtype=meta.seg_starts.dtype, device=meta.seg_starts.device)
    seg = torch.searchsorted(meta.seg_starts[1:], rows, right=True).clamp_(max=meta.num_segments - 1)
    return meta.seg_slot[seg].long().clamp_(min=0)


def add_embedding_lora(
    stack: VocabStack,
    meta: LoRABatchMeta,
    input_ids: torch.Tensor,  # [num_tokens] int64
    hidden: torch.Tensor,  # [num_tokens, hidden] the embedding output; updated in place
    scale: float,  # what the model multiplies the embedding module's output by inside it (Gemma)
    shrunk: torch.Tensor,  # [1, num_tokens, r_max] fp32 scratch
) -> None:
    """``hidden[t] += scale * scaling[slot] * A[slot][:, id_t] @ B[slot].T`` for each token of an
    adapter targeting embed_tokens. ``scale`` is 1 but for Gemma, whose transformers embedding
    module multiplies by sqrt(hidden) in its forward and PEFT scales the LoRA output by the same
    (``Embedding._get_embed_scale``); Granite's multiplier, applied after the module, is not here."""
    if meta.num_segments == 0 or meta.num_tokens == 0:
        return
    ids = input_ids[meta.token_perm]  # [num_tokens] in permuted order
    shrunk[0].copy_(stack.a[permuted_row_slots(meta), ids])  # [num_tokens, r_max]
    scaling = stack.scaling if scale == 1.0 else stack.scaling * scale  # [1, max_loras] fp32
    dispatch.lora_expand(shrunk, stack.b, scaling, (0, stack.out_features), meta, hidden, slot_rank=stack.rank)


class LogitsLoRA:
    """The lm_head LoRA of a set of logit rows (sampled positions, prompt-logprob rows, draft
    verification rows), built by ``LoRAStepContext.logits_lora`` / ``logits_lora``."""

    def __init__(self, stack: VocabStack, meta: LoRABatchMeta, max_rank: int):
        self.stack = stack
        self.meta = meta
        self.max_rank = max_rank

    def apply(self, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """``logits [N, vocab]`` fp32 += each row's lm_head delta from ``hidden [N, hidden]``,
        before any final soft-cap or logits scaling (PEFT adapts the head module itself)."""
        stack, meta = self.stack, self.meta
        shrunk = dispatch.lora_shrink_scratch(logits, meta.num_tokens, self.max_rank, 1)
        dispatch.lora_apply(
            hidden, stack.a, stack.b, stack.scaling, (0, stack.out_features), meta, logits, shrunk,
            slot_rank=stack.rank,
        )
