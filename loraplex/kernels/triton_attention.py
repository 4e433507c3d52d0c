"""Paged-KV attention and KV-cache write in Triton.

Same arguments and semantics as ``dispatch.write_kv_cache`` / ``dispatch.paged_attention`` (and
their torch twins in ``attention_ref``). KV cache per layer is
``[2, num_blocks, block_size, num_kv_heads, head_dim]``.

One attention kernel serves mixed batches: each program takes one sequence, one KV head and a
block of that sequence's query tokens, with all ``num_heads / num_kv_heads`` query heads that
share the KV head stacked as rows of one tile (GQA packing). A decode row (one query token)
therefore fills a 16-row tensor-core tile with a group of heads instead of 15 padding rows, and
every K/V tile is read once for the whole group. Query rows attend to the cached prefix and
causally to their own chunk (prefill-with-prefix), K/V tokens are looked up through the block
table one by one, so any block size works with a fixed key tile. Softmax is the online
(flash) form in base 2. The grid is ``(num_seqs, query blocks of max_query_len, num_kv_heads)``,
from host ints only (graph-capturable); row offsets are int64 before they meet a stride.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,
    kv_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_ptr,  # [num_tokens] int64
    num_kv_heads,
    head_dim,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ckv,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    BLOCK_SIZE: tl.constexpr,  # KV-cache block size
    BLOCK: tl.constexpr,  # >= num_kv_heads * head_dim, a power of two
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    i = tl.arange(0, BLOCK)
    h = i // head_dim
    d = i % head_dim
    mask = h < num_kv_heads
    k = tl.load(key_ptr + tok * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    dst = kv_ptr + blk * stride_cb + off * stride_cs + h * stride_ch + d * stride_cd
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, v.to(kv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    kv_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    out_ptr,  # [num_tokens, num_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_ptr,  # [num_seqs + 1] int32
    qk_scale,  # softmax scale * log2(e)
    head_dim,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ckv,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_SIZE: tl.constexpr,  # KV-cache block size
    BLOCK_M: tl.constexpr,  # rows per program = BLOCK_Q query tokens x GROUP heads (padded)
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per inner step
    BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of two
):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # cached prefix before this step's queries

    m = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + m // GROUP  # query token within the sequence's chunk
    head = kv_head * GROUP + m % GROUP
    row_mask = (m < BLOCK_Q * GROUP) & (q_idx < q_len)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q_rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    q_pos = ctx_len + q_idx  # absolute position of each row's query token
    # keys beyond the last query position of this block are masked for every row: skip them
    kv_end = tl.minimum(seq_len, ctx_len + (q_block + 1) * BLOCK_Q)

    m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)  # finite: no inf - inf on empty rows
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = kv_ptr + kv_head.to(tl.int64) * stride_ch
    v_base = k_base + stride_ckv
    for n0 in range(0, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < kv_end
        phys = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_off = phys * stride_cb + (n % BLOCK_SIZE).to(tl.int64) * stride_cs  # [BLOCK_N]
        k = tl.load(
            k_base + kv_off[None, :] + d[:, None] * stride_cd,
            mask=n_mask[None, :] & d_mask[:, None],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        s = tl.dot(q, k) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        visible = (n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_base + kv_off[:, None] + d[None, :] * stride_cd,
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def write_kv_cache_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; slot < 0 = skip
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        num_kv_heads,
        head_dim,
        *key.stride(),
        *value.stride(),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.stride(4),
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK=triton.next_power_of_2(num_kv_heads * head_dim),
        num_warps=4,
    )


def attention_tiles(group: int, max_query_len: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_Q, BLOCK_N) for a batch: decode-only batches get 16-row tiles of
    GQA-packed heads; batches with prefill chunks get 64-row tiles."""
    if max_query_len <= 1:
        block_m = max(16, triton.next_power_of_2(group))
        block_n = 64
    else:
        block_m = max(64, triton.next_power_of_2(group))
        block_n = 32
    return block_m, block_m // group, block_n


def paged_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    max_query_len: int,
    max_seq_len: int,  # unused: the key loop is bounded per sequence on the device
    *,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim], e.g. a graph's buffer
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's query chunk over its cached prefix and itself.

    Rows of ``out`` outside every sequence's query range (padding) are left as they were."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    num_seqs = block_tables.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    group = num_heads // num_kv_heads
    block_m, block_q, block_n = attention_tiles(group, max_query_len)
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _paged_attention_kernel[grid](
        query,
        kv_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * math.log2(math.e),
        head_dim,
        *query.stride(),
        *kv_cache.stride(),
        *out.stride(),
        block_tables.stride(0),
        GROUP=group,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        num_warps=4,
    )
    return out
