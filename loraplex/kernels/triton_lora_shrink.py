"""The SGMV shrink kernel (``out = x @ A.T`` per segment, fp32 output): launched and described in
``triton_lora``, which chooses its tile shape and K split."""

from __future__ import annotations

import triton
import triton.language as tl

# How the decode-shaped shrink reduces on the CUDA cores (a constexpr of the kernel):
GEMV_REDUCE = tl.constexpr(0)  # a [rows, rank, K-block] product reduced over K in every iteration
GEMV_ACC = tl.constexpr(1)  # products summed element-wise over the K loop, reduced once; next block prefetched
GEMV_ROWS_X_RANK = tl.constexpr(2)  # (row, rank) pairs as the rows of one 2D tile; next block prefetched


@triton.jit(do_not_specialize=["tiles_per_seg", "k_blocks_per_split"])
def _sgmv_shrink_kernel(
    x_ptr,  # [num_tokens, in]
    a_ptr,  # [num_slices, max_loras, r_max, in]
    out_ptr,  # [num_partials, num_slices, num_tokens, r_max] fp32, permuted rows
    token_perm_ptr,  # [num_tokens] int64
    seg_starts_ptr,  # [num_segments + 1] int32
    seg_slot_ptr,  # [num_segments] int32
    slot_rank_ptr,  # [max_loras] int32
    in_features,
    tiles_per_seg,
    k_blocks_per_split,
    stride_xt,
    stride_xk,
    stride_as,
    stride_al,
    stride_ar,
    stride_ak,
    stride_op,  # between K splits' partial outputs; 0 = every split adds into one (ATOMIC)
    stride_os,
    stride_ot,
    stride_or,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    ATOMIC: tl.constexpr,  # splits add into one output with fp32 atomics (in no fixed order)
    EVEN_K: tl.constexpr,  # in_features % BLOCK_K == 0: no K mask, so loads vectorise
    GEMV: tl.constexpr,  # without USE_DOT: how the CUDA cores reduce (see GEMV_*)
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    sl = tl.program_id(2)
    seg = pid // tiles_per_seg
    tile = pid % tiles_per_seg
    slot = tl.load(seg_slot_ptr + seg)
    if slot < 0:
        return
    rank = tl.load(slot_rank_ptr + slot)
    if rank <= 0:
        return
    seg_hi = tl.load(seg_starts_ptr + seg + 1)
    row_lo = tl.load(seg_starts_ptr + seg) + tile * BLOCK_M
    if row_lo >= seg_hi:
        return

    rows = row_lo + tl.arange(0, BLOCK_M)  # permuted row indices
    row_mask = rows < seg_hi
    tok = tl.load(token_perm_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < rank
    # this split's K blocks; block-aligned by construction, which the compiler can see
    kb_lo = split * k_blocks_per_split
    kb_hi = tl.minimum(kb_lo + k_blocks_per_split, tl.cdiv(in_features, BLOCK_K))
    if kb_lo >= kb_hi:
        return  # (the launcher makes no empty split; the prefetch below must not read past `in`)
    offs_k = tl.arange(0, BLOCK_K)
    # each split its own partial output (summed in split order after: deterministic), or with
    # ATOMIC (stride 0) all splits into one
    out_ptr += split.to(tl.int64) * stride_op

    x_rows = x_ptr + tok[:, None] * stride_xt  # [BLOCK_M, 1]
    a_rows = (
        a_ptr
        + sl.to(tl.int64) * stride_as
        + slot.to(tl.int64) * stride_al
        + r[:, None].to(tl.int64) * stride_ar
    )  # [BLOCK_R, 1]
    if USE_DOT or GEMV == GEMV_REDUCE:
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for kb in range(kb_lo, kb_hi):
            xt, at = _shrink_block(x_rows, a_rows, kb, offs_k, row_mask, r_mask, in_features, stride_xk, stride_ak,
                                   BLOCK_K, EVEN_K)
            if USE_DOT:
                acc += tl.dot(xt, tl.trans(at))  # [BLOCK_M, BLOCK_R]
            else:
                prod = xt[:, None, :].to(tl.float32) * at[None, :, :].to(tl.float32)
                acc += tl.sum(prod, axis=2)
    elif GEMV == GEMV_ACC:
        # products summed element-wise across the K loop and reduced once at the end: the loop
        # holds loads and FMAs only; the next K block is loaded before this one is used, so
        # each program keeps two blocks of A in flight
        acc3 = tl.zeros((BLOCK_M, BLOCK_R, BLOCK_K), dtype=tl.float32)
        xt_next, at_next = _shrink_block(x_rows, a_rows, kb_lo, offs_k, row_mask, r_mask, in_features,
                                         stride_xk, stride_ak, BLOCK_K, EVEN_K)
        for kb in range(kb_lo, kb_hi):
            xt, at = xt_next, at_next
            xt_next, at_next = _shrink_block(x_rows, a_rows, tl.minimum(kb + 1, kb_hi - 1), offs_k, row_mask, r_mask,
                                             in_features, stride_xk, stride_ak, BLOCK_K, EVEN_K)
            acc3 += xt[:, None, :].to(tl.float32) * at[None, :, :].to(tl.float32)
        acc = tl.sum(acc3, axis=2)
    else:
        # GEMV_ROWS_X_RANK: one 2D tile whose row j is (token j // BLOCK_R, rank j % BLOCK_R); x
        # and A rows repeat in it (hits in L1), so loads, products and the final reduction
        # share one layout and nothing is shuffled between layouts
        j = tl.arange(0, BLOCK_M * BLOCK_R)
        jm = j // BLOCK_R
        jr = j % BLOCK_R
        j_rows = row_lo + jm
        j_row_mask = j_rows < seg_hi
        j_mask = j_row_mask & (jr < rank)
        j_tok = tl.load(token_perm_ptr + j_rows, mask=j_row_mask, other=0).to(tl.int64)
        xj_rows = x_ptr + j_tok[:, None] * stride_xt
        aj_rows = a_ptr + sl.to(tl.int64) * stride_as + slot.to(tl.int64) * stride_al + jr[:, None].to(tl.int64) * stride_ar
        acc2 = tl.zeros((BLOCK_M * BLOCK_R, BLOCK_K), dtype=tl.float32)
        xt_next, at_next = _shrink_block(xj_rows, aj_rows, kb_lo, offs_k, j_mask, j_mask, in_features,
                                         stride_xk, stride_ak, BLOCK_K, EVEN_K)
        for kb in range(kb_lo, kb_hi):
            xt, at = xt_next, at_next
            xt_next, at_next = _shrink_block(xj_rows, aj_rows, tl.minimum(kb + 1, kb_hi - 1), offs_k, j_mask, j_mask,
                                             in_features, stride_xk, stride_ak, BLOCK_K, EVEN_K)
            acc2 += xt.to(tl.float32) * at.to(tl.float32)
        accj = tl.sum(acc2, axis=1)  # [BLOCK_M * BLOCK_R]
        out_j = out_ptr + sl.to(tl.int64) * stride_os + j_rows.to(tl.int64) * stride_ot + jr * stride_or
        if ATOMIC:
            tl.atomic_add(out_j, accj, mask=j_mask)
        else:
            tl.store(out_j, accj, mask=j_mask)

    if USE_DOT or GEMV != GEMV_ROWS_X_RANK:
        out_ptrs = (
            out_ptr
            + sl.to(tl.int64) * stride_os
            + rows[:, None].to(tl.int64) * stride_ot
            + r[None, :] * stride_or
        )
        out_mask = row_mask[:, None] & r_mask[None, :]
        if ATOMIC:
            tl.atomic_add(out_ptrs, acc, mask=out_mask)
        else:
            tl.store(out_ptrs, acc, mask=out_mask)


@triton.jit(do_not_specialize=["num_tokens", "num_partials"])
def _sum_partials_kernel(
    out_ptr,  # [num_partials, num_slices, num_tokens, r_max] fp32: partial 0 becomes their sum
    num_tokens,
    r_max,
    num_partials,
    stride_op,
    stride_os,
    stride_ot,
    stride_or,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    EVEN_R: tl.constexpr,  # r_max == BLOCK_R: no rank mask, so loads vectorise
):
    """One [rows, rank] tile of one slice: the K splits' partials added in split order."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    r = tl.arange(0, BLOCK_R)
    if EVEN_R:
        mask = (t < num_tokens)[:, None]
    else:
        mask = (t < num_tokens)[:, None] & (r < r_max)[None, :]
    ptrs = out_ptr + tl.program_id(1).to(tl.int64) * stride_os + t[:, None].to(tl.int64) * stride_ot + r[None, :] * stride_or
    total = tl.load(ptrs, mask=mask, other=0.0)
    for p in range(1, num_partials):  # p x stride_op stays far below 2^31: splits x tokens <= PARTIAL_ROWS
        total += tl.load(ptrs + p * stride_op, mask=mask, other=0.0)
    tl.store(ptrs, total, mask=mask)


@triton.jit
def _shrink_block(x_rows, a_rows, kb, offs_k, x_mask, a_mask, in_features, stride_xk, stride_ak,
                  BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """One K block of x rows and A rows (masked rows are not fetched)."""
    k = kb * BLOCK_K + offs_k
    if EVEN_K:
        xt = tl.load(x_rows + k[None, :] * stride_xk, mask=x_mask[:, None], other=0.0)
        at = tl.load(a_rows + k[None, :] * stride_ak, mask=a_mask[:, None], other=0.0)
    else:
        k_mask = k < in_features
        xt = tl.load(x_rows + k[None, :] * stride_xk, mask=x_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_rows + k[None, :] * stride_ak, mask=a_mask[:, None] & k_mask[None, :], other=0.0)
    return xt, at
