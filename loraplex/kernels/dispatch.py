"""The one place that chooses between Triton kernels (CUDA tensors) and their torch reference
twins (CPU). Everything above ``loraplex.kernels`` calls these functions only (the model's LoRA
context calls ``lora_apply``; ``lora_shrink``/``lora_expand`` are its two halves).

Shapes (DESIGN.md contracts):

* KV cache per layer: ``kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]``
* ``block_tables[num_seqs, max_blocks]`` int32, ``slot_mapping[num_tokens]`` int64,
  ``seq_lens[num_seqs]`` int32 (cached prefix + this step's query tokens),
  ``query_start_loc[num_seqs + 1]`` int32 (cumulative query lengths).
* LoRA: ``a_stack[num_slices, max_loras, r_max, in]``, ``b_stack[max_loras, out_total, r_max]``
  (slices concatenated along ``out``, slice ``s`` is rows ``slice_offsets[s]:slice_offsets[s+1]``),
  ``scaling[num_slices, max_loras]`` fp32 (per module, so ``alpha_pattern`` is honoured).
"""

from __future__ import annotations


import torch

from loraplex.kernels.lora_meta import LoRABatchMeta
from loraplex.kernels.moe_lora import ExpertLoRA
from loraplex.kernels.moe_torch import ExpertScales


def uses_triton(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device are the Triton ones (CUDA) or the torch twins (CPU)."""
    return t.is_cuda



def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; slot < 0 = skip (padding)
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store each token's K and V at its slot: ``x / scale`` (the layer's KV-cache scales, host
    floats), in the cache's dtype (an fp8 one rounds and saturates: ``kv_quant``)."""
    if uses_triton(key):
        from loraplex.kernels.triton_attention import write_kv_cache_triton

        return write_kv_cache_triton(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    from loraplex.kernels.attention_cpu import write_kv_cache_cpu

    return write_kv_cache_cpu(key, value, kv_cache, slot_mapping, k_scale, v_scale)


def plan_paged_attention(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim] (any layer's)
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
) -> object | None:
    """The step's attention work planned once from the metadata, for every layer's
    ``paged_attention(..., plan=)``. ``None`` on CUDA: the Triton kernel needs no plan."""
    if uses_triton(kv_cache):
        return None
    from loraplex.kernels.attention_cpu import plan_paged_attention as plan_cpu

    return plan_cpu(block_tables, seq_lens, query_start_loc, kv_cache.shape[2])


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    max_query_len: int,  # host ints: grid sizes without a device sync
    max_seq_len: int,
    plan: object | None = None,  # from plan_paged_attention for this step's metadata
    *,
    sliding_window: int | None = None,  # this layer's window; None = full causal attention
    softcap: float | None = None,  # attention logit soft-cap; None = none
    k_scale: float = 1.0,  # the layer's KV-cache scales (host floats): K, V read as stored * scale
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's query chunk over its cached prefix and itself.

    The query tokens of sequence ``i`` are the last ``q_len_i`` positions of its ``seq_lens[i]``;
    their K/V must already be written to the cache (``write_kv_cache``) before this call. So
    must the whole step's: with prefix caching a sequence may read a block that another
    sequence of the same step fills (see ``BlockManager``), so a kernel that fuses the write
    into the attention has to finish every write before any read.

    ``sliding_window``: a query at position p attends to keys at positions > p - window only,
    and no path reads a block wholly before its first query's window: a windowed layer group's
    pages before it go back to the pool, their table entries ``FREED_BLOCK`` (-1). ``softcap``: each scaled score s becomes
    ``tanh(s / softcap) * softcap`` before the mask and softmax (Gemma 2). The defaults are the
    plain causal attention, with no extra work in any path. ``k_scale`` / ``v_scale``: attention
    over the cached K/V times them (``kv_quant``); the paths fold them into the softmax scale and
    the output, so 1.0 costs nothing.
    """
    if uses_triton(query):
        from loraplex.kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(
            query, kv_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len, max_seq_len,
            sliding_window=sliding_window, softcap=softcap, k_scale=k_scale, v_scale=v_scale,
        )
    # CPU: the batched twin of attention_ref (same result; the reference stays the test oracle)
    from loraplex.kernels.attention_cpu import paged_attention_cpu

    return paged_attention_cpu(
        query, kv_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len, max_seq_len, plan,
        sliding_window=sliding_window, softcap=softcap, k_scale=k_scale, v_scale=v_scale,
    )


def lora_shrink_scratch(
    like: torch.Tensor, num_tokens: int, max_rank: int, num_slices: int
) -> torch.Tensor | None:  # [max_partials, num_slices, num_tokens, max_rank] fp32, or None on CPU
    """The fp32 buffer ``lora_shrink`` writes and ``lora_expand`` reads, on ``like``'s device:
    room for the Triton shrink's K-split partial outputs (``max_shrink_partials``). None on CPU,
    whose fused ``lora_apply`` needs none."""
    if not uses_triton(like):
        return None
    from loraplex.kernels.triton_lora import max_shrink_partials

    shape = (max_shrink_partials(num_tokens), num_slices, num_tokens, max_rank)
    return torch.empty(shape, dtype=torch.float32, device=like.device)


def lora_shrink(
    x: torch.Tensor,  # [num_tokens, in] (original token order)
    a_stack: torch.Tensor,  # [num_slices, max_loras, r_max, in]
    meta: LoRABatchMeta,
    out: torch.Tensor,  # [max_partials, num_slices, num_tokens, r_max] fp32 (lora_shrink_scratch; 3D: one)
    *,
    slot_rank: torch.Tensor | None = None,  # [max_loras] int32: ranks to use instead of meta's
) -> torch.Tensor:  # [num_slices, num_tokens, r_max] fp32, rows in permuted order: out[0], for lora_expand
    """``result[s, i, :r] = x[token_perm[i]] @ a_stack[s, slot, :r].T`` for every LoRA row ``i``
    (``slot = seg_slot`` of its segment, ``r = slot_rank[slot]``). The Triton kernel may split
    ``in`` over ``out``'s other partial outputs and sum them into the first, in a fixed order
    (with the tuning's ``split_sum="expand"`` in a decode-shaped step it returns the partials,
    ``[splits, num_slices, num_tokens, r_max]``, and ``lora_expand`` adds them as it reads them).
    Columns ``>= r`` and base-only rows are left unspecified; expand never reads them."""
    if uses_triton(x):
        from loraplex.kernels.triton_lora import lora_shrink_triton

        return lora_shrink_triton(x, a_stack, meta, out, slot_rank=slot_rank)
    # CPU: the reference (the engine's CPU path is the fused ``lora_apply``)
    from loraplex.kernels.lora_ref import lora_shrink_ref

    result = out[0] if out.dim() == 4 else out
    lora_shrink_ref(x, a_stack, meta, result)
    return result


def lora_expand(
    shrunk: torch.Tensor,  # [num_slices, num_tokens, r_max] fp32 (or [splits, ...]), from lora_shrink
    b_stack: torch.Tensor,  # [max_loras, out_total, r_max]
    scaling: torch.Tensor,  # [num_slices, max_loras] fp32
    slice_offsets: tuple[int, ...],  # num_slices + 1 offsets into out_total
    meta: LoRABatchMeta,
    y: torch.Tensor,  # [num_tokens, out_total] base output, original order; updated in place
    *,
    slot_rank: torch.Tensor | None = None,  # [max_loras] int32: ranks to use instead of meta's
) -> None:
    """``y[token_perm[i], off_s:off_s1] += scaling[s, slot] * shrunk[s, i, :r] @ b_stack[slot, off_s:off_s1, :r].T``
    for every LoRA row ``i`` and slice ``s``, all slices in one call."""
    if uses_triton(y):
        from loraplex.kernels.triton_lora import lora_expand_triton

        return lora_expand_triton(shrunk, b_stack, scaling, slice_offsets, meta, y, slot_rank=slot_rank)
    from loraplex.kernels.lora_ref import lora_expand_ref

    return lora_expand_ref(shrunk, b_stack, scaling, slice_offsets, meta, y)


def lora_apply(
    x: torch.Tensor,  # [num_tokens, in] (original token order)
    a_stack: torch.Tensor,  # [num_slices, max_loras, r_max, in]
    b_stack: torch.Tensor,  # [max_loras, out_total, r_max]
    scaling: torch.Tensor,  # [num_slices, max_loras] fp32
    slice_offsets: tuple[int, ...],  # num_slices + 1 offsets into out_total
    meta: LoRABatchMeta,
    y: torch.Tensor,  # [num_tokens, out_total] base output, original order; updated in place
    shrunk: torch.Tensor | None,  # [max_partials, num_slices, num_tokens, r_max] fp32 scratch; CUDA only
    *,
    slot_rank: torch.Tensor | None = None,  # [max_loras] int32: this projection's ranks, else meta's
) -> None:
    """``lora_shrink`` then ``lora_expand``: the one call the model's LoRA context makes.

    On CUDA the two Triton kernels run through ``shrunk`` (``lora_shrink_scratch``), reading no
    weights past ``slot_rank`` (a projection's own ranks: 0 where a slot's adapter leaves it
    alone; rows past them are zero, so the result is the same); on CPU a fused twin keeps each
    batch's shrink result local (``shrunk`` may be None), which halves the small ops per projection."""
    if uses_triton(y):
        result = lora_shrink(x, a_stack, meta, shrunk, slot_rank=slot_rank)
        lora_expand(result, b_stack, scaling, slice_offsets, meta, y, slot_rank=slot_rank)
        return
    from loraplex.kernels.lora_cpu import lora_apply_cpu

    lora_apply_cpu(x, a_stack, b_stack, scaling, slice_offsets, meta, y)


def fused_moe(
    x: torch.Tensor,  # [T, H]
    weights: torch.Tensor,  # [T, k] routing weights (fp32, or x's dtype)
    experts: torch.Tensor,  # [T, k] int64 expert ids
    gate_up: torch.Tensor,  # [E, 2 * I, H]: gate rows then up rows
    down: torch.Tensor,  # [E, H, I]
    lora: ExpertLoRA | None = None,  # the step's expert LoRA in this layer
    scales: ExpertScales | None = None,  # fp8 gate_up / down: their scales (W8A16)
) -> torch.Tensor:  # [T, H]
    """Each token's routing-weighted sum of its k experts' SwiGLU outputs, summed in fp32 and
    rounded once; with ``lora``, each pair's LoRA delta added to gate_up (before the SiLU) and
    to down (before the routing weight). On CUDA the fused Triton kernels (no host sync, a grid
    from host ints only: capturable in a CUDA graph); on CPU the torch loop over the experts
    that got tokens. ``scales``: the experts are fp8 (``ExpertScales``); the kernels upcast each
    weight tile and scale the fp32 accumulator, the CPU loop dequantizes each expert it runs."""
    if uses_triton(x):
        from loraplex.kernels.triton_moe import fused_moe_triton

        return fused_moe_triton(x, weights, experts, gate_up, down, lora=lora, scales=scales)
    from loraplex.kernels.moe_torch import run_experts

    return run_experts(x, weights, experts, gate_up, down, lora, scales)
