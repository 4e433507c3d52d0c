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
(flash) form in base 2. The grid is ``(num_seqs, query blocks of max_query_len, num_kv_heads x
num_kv_splits)``, from host ints only (graph-capturable); row offsets are int64 before they meet
a stride.

Split-KV (flash-decoding): a decode batch of few sequences gives too few programs to fill the
GPU (one sequence x 8 KV heads = 8 programs on 132 SMs) while each walks a long context. Such
batches split every sequence's keys into ``num_kv_splits`` equal ranges, one program each; the
programs write a normalised partial output and its log-sum-exp (base 2) to fp32 scratch, and a
second kernel merges the splits of each (token, head). The split count is chosen on the host
from the batch shape (``choose_num_kv_splits``); each sequence divides its own length, so a
graph runner may pass an upper bound of ``max_seq_len`` and short sequences merely leave some
splits empty.

Two per-layer options are constexprs, so a kernel without them compiles as before: a sliding
window (``SLIDING``; a query at position p sees keys at positions > p - window, and the key loop
starts at the first query's window, so a long context costs only the window) and logit
soft-capping (``SOFTCAP``; scores pass through ``softcap * tanh(s / softcap)``, Gemma 2).

An fp8 KV cache (``kv_quant``): the write quantizes in torch (``x / scale``) and the kernel
stores the bytes; the attention kernel loads fp8 K/V tiles and casts them to the query's dtype
before the dot products (a no-op for a cache in the model's dtype). The layer's scales are host
floats (fixed at load, so a captured graph holds them as constants, and nothing is read from
the device for them) folded where they cost nothing: ``k_scale`` into the softmax scale
(``q . (k * s) = (q . k) * s``), ``v_scale`` into the output's normalisation (each split's
partial too, so the merge, a weighted mean, stays right). 1.0 leaves every result bit-identical.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from loraplex.kernels.kv_quant import as_bytes, is_fp8, quantize_kv


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


@triton.jit(do_not_specialize=["num_kv_splits"])
def _paged_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    kv_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    out_ptr,  # [num_tokens, num_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_ptr,  # [num_seqs + 1] int32
    qk_scale,  # softmax scale * log2(e); scale / softcap when SOFTCAP
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
    num_kv_splits,  # 1: write the output; > 1: write partials to out_ptr[split] and lse_ptr
    stride_os,  # split stride of the partial output (0 when not split)
    lse_ptr,  # [num_kv_splits, num_tokens, num_heads] fp32 (unused when not split)
    stride_ls,
    stride_lt,
    stride_lh,
    window,  # sliding window in positions (read only when SLIDING)
    softcap_log2,  # softcap * log2(e) (read only when SOFTCAP; qk_scale is then scale / softcap)
    v_scale,  # the layer's V scale: V is read as stored * v_scale (k_scale is inside qk_scale)
    SPLIT_KV: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
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
    kv_split = 0
    if SPLIT_KV:
        kv_head = tl.program_id(2) // num_kv_splits
        kv_split = tl.program_id(2) % num_kv_splits
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
    kv_start = 0
    if SLIDING:  # keys at or before the first row's window edge are masked for every row
        kv_start = tl.maximum(ctx_len + q_block * BLOCK_Q - window + 1, 0)
    if SPLIT_KV:  # this program's share of the keys, whole key tiles; the last ones may be empty
        keys_per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, num_kv_splits), BLOCK_N) * BLOCK_N
        kv_start += kv_split * keys_per_split
        kv_end = tl.minimum(kv_end, kv_start + keys_per_split)

    m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)  # finite: no inf - inf on empty rows
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = kv_ptr + kv_head.to(tl.int64) * stride_ch
    v_base = k_base + stride_ckv
    for n0 in range(kv_start, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < kv_end
        phys = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_off = phys * stride_cb + (n % BLOCK_SIZE).to(tl.int64) * stride_cs  # [BLOCK_N]
        k = tl.load(
            k_base + kv_off[None, :] + d[:, None] * stride_cd,
            mask=n_mask[None, :] & d_mask[:, None],
            other=0.0,
        ).to(q.dtype)  # [BLOCK_D, BLOCK_N]; an fp8 cache upcast (its k_scale is in qk_scale)
        s = tl.dot(q, k) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units (without SOFTCAP)
        if SOFTCAP:  # s is q.k * scale / softcap: tanh(s) written with exp2 (2 * log2(e) = 2.885...)
            s = softcap_log2 * (1.0 - 2.0 / (tl.exp2(s * 2.885390081777927) + 1.0))
        visible = (n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if SLIDING:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_base + kv_off[:, None] + d[None, :] * stride_cd,
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        ).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]) * v_scale
    out_base = out_ptr
    if SPLIT_KV:
        out_base += kv_split.to(tl.int64) * stride_os
    tl.store(
        out_base + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )
    if SPLIT_KV:  # rows that saw no key in this split weigh nothing in the merge
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), -1.0e30)
        tl.store(
            lse_ptr + kv_split.to(tl.int64) * stride_ls + q_rows * stride_lt + head * stride_lh,
            lse,
            mask=row_mask,
        )


@triton.jit(do_not_specialize=["num_kv_splits"])
def _merge_kv_splits_kernel(
    partial_ptr,  # [num_kv_splits, num_tokens, num_heads, head_dim] fp32
    lse_ptr,  # [num_kv_splits, num_tokens, num_heads] fp32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_start_ptr,  # [num_seqs + 1] int32
    num_kv_splits,
    head_dim,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_pd,
    stride_ls,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    stride_od,
    BLOCK_S: tl.constexpr,  # >= num_kv_splits, a power of two
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_ptr + seq)
    q_end = tl.load(query_start_ptr + seq + 1)
    sp = tl.arange(0, BLOCK_S)
    sp_mask = sp < num_kv_splits
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    first_row = q_start.to(tl.int64)
    for i in range(0, q_end - q_start):  # only rows a sequence owns (padding rows stay as they were)
        row = first_row + i
        lse = tl.load(lse_ptr + sp * stride_ls + row * stride_lt + head * stride_lh, mask=sp_mask, other=-1.0e30)
        weight = tl.exp2(lse - tl.max(lse, axis=0))  # [BLOCK_S]; empty splits weigh 0
        weight = tl.where(sp_mask, weight, 0.0)
        part = tl.load(
            partial_ptr + sp[:, None] * stride_ps + row * stride_pt + head * stride_ph + d[None, :] * stride_pd,
            mask=sp_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_S, BLOCK_D]
        merged = tl.sum(part * weight[:, None], axis=0) / tl.sum(weight, axis=0)
        tl.store(
            out_ptr + row * stride_ot + head * stride_oh + d * stride_od,
            merged.to(out_ptr.dtype.element_ty),
            mask=d_mask,
        )


def write_kv_cache_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; slot < 0 = skip
    k_scale: float = 1.0,  # the layer's KV-cache scales: stored = x / scale
    v_scale: float = 1.0,
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if is_fp8(kv_cache.dtype) or k_scale != 1.0 or v_scale != 1.0:  # quantized in torch (kv_quant)
        key, value = quantize_kv(key, kv_cache.dtype, k_scale), quantize_kv(value, kv_cache.dtype, v_scale)
    if is_fp8(kv_cache.dtype):  # so the kernel copies bytes
        key, value, kv_cache = as_bytes(key), as_bytes(value), as_bytes(kv_cache)
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


MAX_KV_SPLITS = 32
MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed costs (its partial row, the merge) dominate


def choose_num_kv_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, num_sms: int) -> int:
    """How many key ranges each sequence of a decode batch is split into: enough programs for
    about two per SM, never a split under ``MIN_KEYS_PER_SPLIT`` keys; 1 for batches with prompt
    chunks (their query tiles already make many programs) and for batches that fill the GPU."""
    if max_query_len != 1:
        return 1
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    by_occupancy = -(-2 * num_sms // programs)
    by_length = max_seq_len // MIN_KEYS_PER_SPLIT
    return max(1, min(by_occupancy, by_length, MAX_KV_SPLITS))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter (CPU tensors) chooses as on an H100 / H200
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    max_query_len: int,
    max_seq_len: int,  # an upper bound is enough: it only sizes the split-KV choice
    *,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim], e.g. a graph's buffer
    num_kv_splits: int | None = None,  # None: choose_num_kv_splits for this batch and GPU
    sliding_window: int | None = None,  # keys at positions > q_pos - window only
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap)
    k_scale: float = 1.0,  # the layer's KV-cache scales: K and V are read as stored * scale
    v_scale: float = 1.0,
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
    block_d = max(16, triton.next_power_of_2(head_dim))
    if num_kv_splits is None:
        keys = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)  # keys a row reads
        num_kv_splits = choose_num_kv_splits(num_seqs, num_kv_heads, max_query_len, keys, _num_sms(query.device))
    split = num_kv_splits > 1
    if split:
        partial = torch.empty(num_kv_splits, num_tokens, num_heads, head_dim, dtype=torch.float32, device=query.device)
        lse = torch.empty(num_kv_splits, num_tokens, num_heads, dtype=torch.float32, device=query.device)
        target, split_strides = partial, (partial.stride(0), lse, *lse.stride())
    else:
        target, split_strides = out, (0, out, 0, 0, 0)
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads * num_kv_splits)
    _paged_attention_kernel[grid](
        query,
        kv_cache,
        target,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * k_scale * math.log2(math.e) if softcap is None else scale * k_scale / softcap,
        head_dim,
        *query.stride(),
        *kv_cache.stride(),
        *target.stride()[-3:],
        block_tables.stride(0),
        num_kv_splits,
        *split_strides,
        0 if sliding_window is None else sliding_window,
        0.0 if softcap is None else softcap * math.log2(math.e),
        float(v_scale),
        SPLIT_KV=split,
        SLIDING=sliding_window is not None,
        SOFTCAP=softcap is not None,
        GROUP=group,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=4,
    )
    if split:
        _merge_kv_splits_kernel[(num_seqs, num_heads)](
            partial,
            lse,
            out,
            query_start_loc,
            num_kv_splits,
            head_dim,
            *partial.stride(),
            *lse.stride(),
            *out.stride(),
            BLOCK_S=triton.next_power_of_2(num_kv_splits),
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out
