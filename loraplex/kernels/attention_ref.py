"""Torch reference of the paged-KV attention kernels (CPU path and the kernels' test oracle).

Same arguments as ``dispatch.write_kv_cache`` / ``dispatch.paged_attention``. Written for
clarity: one sequence at a time, K/V gathered through the block table. The cache is read back
in fp32 times the layer's ``k_scale`` / ``v_scale`` (``kv_quant``) before any product: attention
over the dequantized K/V.
"""

from __future__ import annotations

import torch

from loraplex.kernels.kv_quant import dequantize_kv, quantize_kv


def write_kv_cache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = quantize_kv(key[valid], kv_cache.dtype, k_scale)  # fp8: saturating
    kv_cache[1, blocks, offsets] = quantize_kv(value[valid], kv_cache.dtype, v_scale)


def gather_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, first_block: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's positions ``first_block * block_size`` to ``seq_len - 1``: each
    ``[seq_len - first_block * block_size, num_kv_heads, head_dim]``."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[first_block:num_blocks].long()
    length = seq_len - first_block * block_size
    k = kv_cache[0, blocks].reshape(-1, *kv_cache.shape[3:])[:length]
    v = kv_cache[1, blocks].reshape(-1, *kv_cache.shape[3:])[:length]
    return k, v


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    max_query_len: int = 0,
    max_seq_len: int = 0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """``sliding_window``: a query at position p sees keys at positions > p - window (and <= p),
    and the blocks wholly before the first query's window are not read (the block manager may
    have freed them); ``softcap``: scores become ``tanh(scores / softcap) * softcap`` before the
    mask (Gemma 2); ``k_scale`` / ``v_scale``: the layer's KV-cache scales."""
    num_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        first_block = 0
        if sliding_window is not None:
            first_block = max(0, seq_len - q_len - sliding_window + 1) // kv_cache.shape[2]
        k, v = gather_kv(kv_cache, block_tables[i], seq_len, first_block)
        q = query[q_start:q_end].float().transpose(0, 1)  # [H, q_len, D]
        k = dequantize_kv(k, k_scale).repeat_interleave(group, dim=1).transpose(0, 1)  # [H, keys, D]
        v = dequantize_kv(v, v_scale).repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (q @ k.transpose(1, 2)) * scale  # [H, q_len, keys]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        # query row j sits at absolute position seq_len - q_len + j and sees keys up to it
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
        k_pos = torch.arange(first_block * kv_cache.shape[2], seq_len, device=query.device).unsqueeze(0)
        hidden = k_pos > q_pos
        if sliding_window is not None:
            hidden |= k_pos <= q_pos - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = (probs @ v).transpose(0, 1).to(query.dtype)
    return out
