"""The SGMV expand kernels (``y += scaling * shrunk @ B.T`` per segment, every slice of a packed
projection in one launch): launched and described in ``triton_lora``, which chooses between them."""

from __future__ import annotations

import triton
import triton.language as tl

# slice offsets stay specialised: they are per-module constants, and knowing they are multiples
# of 16 lets the y accesses vectorise
@triton.jit(do_not_specialize=["tiles_per_seg", "num_partials"])
def _sgmv_expand_kernel(
    s_ptr,  # [num_slices, num_tokens, r_max] fp32, permuted rows
    b_ptr,  # [max_loras, out_total, r_max]
    scaling_ptr,  # [num_slices, max_loras] fp32
    y_ptr,  # [num_tokens, out_total], original order
    token_perm_ptr,
    seg_starts_ptr,
    seg_slot_ptr,
    slot_rank_ptr,
    tiles_per_seg,
    off0,
    off1,
    off2,
    off3,
    off4,
    stride_ss,
    stride_st,
    stride_sr,
    stride_bl,
    stride_bn,
    stride_br,
    stride_cs,
    stride_cl,
    stride_yt,
    stride_yn,
    num_partials,  # with SUM_PARTIALS: the shrink's K splits, summed here in split order
    stride_sp,  # between those partial outputs
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    USE_DOT: tl.constexpr,
    R_EVEN: tl.constexpr,  # r_max % BLOCK_R == 0: rank chunks need no bounds mask
    SUM_PARTIALS: tl.constexpr = False,  # s_ptr holds num_partials partial outputs, not their sum
):
    pid = tl.program_id(0)
    pid_n = tl.program_id(1)
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
    # this slice's columns of y: [n_lo, n_hi)
    n_lo, n_hi = _slice_columns(sl, off0, off1, off2, off3, off4)
    n_start = n_lo + pid_n * BLOCK_N
    if n_start >= n_hi:
        return

    rows = row_lo + tl.arange(0, BLOCK_M)
    row_mask = rows < seg_hi
    tok = tl.load(token_perm_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    n = n_start + tl.arange(0, BLOCK_N)
    n_mask = n < n_hi
    scale = tl.load(scaling_ptr + sl * stride_cs + slot * stride_cl)

    s_rows = s_ptr + sl.to(tl.int64) * stride_ss + rows[:, None].to(tl.int64) * stride_st  # [BLOCK_M, 1]
    b_cols = b_ptr + slot.to(tl.int64) * stride_bl + n[None, :].to(tl.int64) * stride_bn  # [1, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):  # the slot's real rank, not r_max
        r = r0 + tl.arange(0, BLOCK_R)
        r_mask = r < rank
        if R_EVEN:
            # whole 16-wide chunks (inside the r_max storage), so the loads vectorise; columns
            # past the real rank (padding, unspecified shrink output, even NaN) are selected away
            st = tl.load(s_rows + r[None, :] * stride_sr, mask=row_mask[:, None], other=0.0)
            if SUM_PARTIALS:
                for p in range(1, num_partials):
                    st += tl.load(s_rows + p * stride_sp + r[None, :] * stride_sr, mask=row_mask[:, None], other=0.0)
            bt = tl.load(b_cols + r[:, None] * stride_br, mask=n_mask[None, :], other=0.0)
            st = tl.where(r_mask[None, :], st, 0.0)
            bt = tl.where(r_mask[:, None], bt, 0.0)
        else:
            st = tl.load(s_rows + r[None, :] * stride_sr, mask=row_mask[:, None] & r_mask[None, :], other=0.0)
            if SUM_PARTIALS:
                for p in range(1, num_partials):
                    st += tl.load(s_rows + p * stride_sp + r[None, :] * stride_sr,
                                  mask=row_mask[:, None] & r_mask[None, :], other=0.0)
            bt = tl.load(b_cols + r[:, None] * stride_br, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        if USE_DOT:
            acc += tl.dot(st.to(bt.dtype), bt)  # [BLOCK_M, BLOCK_N]
        else:
            acc += tl.sum(st[:, :, None] * bt[None, :, :].to(tl.float32), axis=1)

    y_ptrs = y_ptr + tok[:, None] * stride_yt + n[None, :] * stride_yn
    y_mask = row_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc * scale).to(y.dtype), mask=y_mask)


@triton.jit(do_not_specialize=["n_tiles", "num_partials"])
def _sgmv_expand_gemv_kernel(
    s_ptr,  # [num_slices, num_tokens, r_max] fp32, permuted rows
    b_ptr,  # [max_loras, out_total, r_max]
    scaling_ptr,  # [num_slices, max_loras] fp32
    y_ptr,  # [num_tokens, out_total], original order
    token_perm_ptr,
    seg_starts_ptr,
    seg_slot_ptr,
    slot_rank_ptr,
    n_tiles,  # column tiles per program
    off0,
    off1,
    off2,
    off3,
    off4,
    stride_ss,
    stride_st,
    stride_sr,
    stride_bl,
    stride_bn,
    stride_br,
    stride_cs,
    stride_cl,
    stride_yt,
    stride_yn,
    num_partials,  # with SUM_PARTIALS: the shrink's K splits, summed here in split order
    stride_sp,  # between those partial outputs
    BLOCK_M: tl.constexpr,  # >= the longest segment: one row tile per segment
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,  # >= the largest rank: the whole rank in one tile
    R_EVEN: tl.constexpr,  # r_max % 16 == 0: whole 16-wide rank chunks may be read
    ROWS: tl.constexpr,  # the segment's rows one at a time ("rows"), or all at once ("tiled")
    AHEAD: tl.constexpr,  # with ROWS: every row's y loaded a tile ahead ("rows_ahead")
    SUM_PARTIALS: tl.constexpr = False,  # s_ptr holds num_partials partial outputs, not their sum
):
    """Decode-shaped expand: one program per (segment, run of ``n_tiles`` column tiles, slice)."""
    seg = tl.program_id(0)
    pid_n = tl.program_id(1)
    sl = tl.program_id(2)
    slot = tl.load(seg_slot_ptr + seg)
    if slot < 0:
        return
    rank = tl.load(slot_rank_ptr + slot)
    if rank <= 0:
        return
    row_lo = tl.load(seg_starts_ptr + seg)
    seg_hi = tl.load(seg_starts_ptr + seg + 1)
    if row_lo >= seg_hi:
        return
    n_lo, n_hi = _slice_columns(sl, off0, off1, off2, off3, off4)
    n_first = n_lo + pid_n * n_tiles * BLOCK_N
    if n_first >= n_hi:
        return

    r = tl.arange(0, BLOCK_R)
    r_keep = r < rank
    if R_EVEN:
        # whole 16-wide chunks up to the real rank, so the loads stay 16 bytes wide; the padding
        # columns read (unspecified, even NaN) are selected away below
        r_read = r < (rank + 15) // 16 * 16
    else:
        r_read = r_keep
    scale = tl.load(scaling_ptr + sl * stride_cs + slot * stride_cl)
    offs_n = tl.arange(0, BLOCK_N)
    n_stop = tl.minimum(n_hi, n_first + n_tiles * BLOCK_N)  # this program's columns end here
    n = n_first + offs_n
    s_base = s_ptr + sl.to(tl.int64) * stride_ss
    if AHEAD:
        # as "rows", but no row waits on the one before: "rows" loads a row's y after storing the
        # previous row's (the compiler cannot move a load above a store that may alias it), so a
        # tile costs one memory round trip per row. Here each row's token, shrink output and
        # next tile's y are loaded a tile ahead, with the next B tile (tuples: one entry a row)
        b_cols = b_ptr + slot.to(tl.int64) * stride_bl + r[None, :] * stride_br  # [1, BLOCK_R]
        toks = ()
        s_rows = ()
        for m in tl.static_range(BLOCK_M):
            # rows past the segment read its last row again; their y is neither loaded nor stored
            row = tl.minimum(row_lo + m, seg_hi - 1)
            toks = toks + (tl.load(token_perm_ptr + row).to(tl.int64),)
            s_m = tl.load(s_base + row.to(tl.int64) * stride_st + r * stride_sr, mask=r_read, other=0.0)
            if SUM_PARTIALS:
                for p in range(1, num_partials):
                    s_m += tl.load(s_base + p * stride_sp + row.to(tl.int64) * stride_st + r * stride_sr, mask=r_read,
                                   other=0.0)
            s_rows = s_rows + (tl.where(r_keep, s_m, 0.0),)  # [BLOCK_R] fp32
        bt_next = tl.load(b_cols + n[:, None].to(tl.int64) * stride_bn, mask=(n < n_stop)[:, None] & r_read[None, :],
                          other=0.0)
        y_next = _y_rows(y_ptr, toks, row_lo, seg_hi, n, n_stop, stride_yt, stride_yn, BLOCK_M)
        for t in range(n_tiles):
            n = n_first + t * BLOCK_N + offs_n
            bt = bt_next
            y_rows = y_next
            n_next = n + BLOCK_N
            bt_next = tl.load(b_cols + n_next[:, None].to(tl.int64) * stride_bn,
                              mask=(n_next < n_stop)[:, None] & r_read[None, :], other=0.0)
            y_next = _y_rows(y_ptr, toks, row_lo, seg_hi, n_next, n_stop, stride_yt, stride_yn, BLOCK_M)
            bt = tl.where(r_keep[None, :], bt, 0.0).to(tl.float32)  # [BLOCK_N, BLOCK_R]
            for m in tl.static_range(BLOCK_M):
                acc = tl.sum(bt * s_rows[m][None, :], axis=1)  # [BLOCK_N]
                y = y_rows[m]
                n_end = tl.where(row_lo + m < seg_hi, n_hi, 0)
                tl.store(y_ptr + toks[m] * stride_yt + n * stride_yn, (y.to(tl.float32) + acc * scale).to(y.dtype),
                         mask=n < n_end)
    elif ROWS:
        # B as [columns, rank] tiles (rank contiguous: each column's products are summed in the
        # registers that loaded them), then the segment's rows one by one, each a run of y
        b_cols = b_ptr + slot.to(tl.int64) * stride_bl + r[None, :] * stride_br  # [1, BLOCK_R]
        bt_next = tl.load(b_cols + n[:, None].to(tl.int64) * stride_bn, mask=(n < n_stop)[:, None] & r_read[None, :],
                          other=0.0)
        for t in range(n_tiles):
            n = n_first + t * BLOCK_N + offs_n
            bt = bt_next
            # the next tile's B is requested before this tile's y: two tiles in flight per program
            n_next = n + BLOCK_N
            bt_next = tl.load(b_cols + n_next[:, None].to(tl.int64) * stride_bn,
                              mask=(n_next < n_stop)[:, None] & r_read[None, :], other=0.0)
            bt = tl.where(r_keep[None, :], bt, 0.0).to(tl.float32)  # [BLOCK_N, BLOCK_R]
            n_mask = n < n_hi  # (n_hi: a multiple of 16, so y accesses vectorise)
            for m in tl.static_range(BLOCK_M):
                row = row_lo + m
                if row < seg_hi:
                    tok_m = tl.load(token_perm_ptr + row).to(tl.int64)
                    s_m = tl.load(s_base + row.to(tl.int64) * stride_st + r * stride_sr, mask=r_read, other=0.0)
                    if SUM_PARTIALS:
                        for p in range(1, num_partials):
                            s_m += tl.load(s_base + p * stride_sp + row.to(tl.int64) * stride_st + r * stride_sr,
                                           mask=r_read, other=0.0)
                    s_m = tl.where(r_keep, s_m, 0.0)  # [BLOCK_R] fp32
                    acc = tl.sum(bt * s_m[None, :], axis=1)  # [BLOCK_N]
                    y_ptrs = y_ptr + tok_m * stride_yt + n * stride_yn
                    y = tl.load(y_ptrs, mask=n_mask, other=0.0)
                    tl.store(y_ptrs, (y.to(tl.float32) + acc * scale).to(y.dtype), mask=n_mask)
    else:
        # the segment's rows at once: [rows, rank, columns] products reduced over the rank
        rows = row_lo + tl.arange(0, BLOCK_M)
        row_mask = rows < seg_hi
        tok = tl.load(token_perm_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        st = tl.load(s_base + rows[:, None].to(tl.int64) * stride_st + r[None, :] * stride_sr,
                     mask=row_mask[:, None] & r_read[None, :], other=0.0)
        if SUM_PARTIALS:
            for p in range(1, num_partials):
                st += tl.load(s_base + p * stride_sp + rows[:, None].to(tl.int64) * stride_st + r[None, :] * stride_sr,
                              mask=row_mask[:, None] & r_read[None, :], other=0.0)
        st = tl.where(r_keep[None, :], st, 0.0)  # [BLOCK_M, BLOCK_R] fp32
        b_rows = b_ptr + slot.to(tl.int64) * stride_bl + r[:, None] * stride_br  # [BLOCK_R, 1]
        bt_next = tl.load(b_rows + n[None, :].to(tl.int64) * stride_bn, mask=r_read[:, None] & (n < n_stop)[None, :],
                          other=0.0)
        for t in range(n_tiles):
            n = n_first + t * BLOCK_N + offs_n
            bt = bt_next
            n_next = n + BLOCK_N
            bt_next = tl.load(b_rows + n_next[None, :].to(tl.int64) * stride_bn,
                              mask=r_read[:, None] & (n_next < n_stop)[None, :], other=0.0)
            y_ptrs = y_ptr + tok[:, None] * stride_yt + n[None, :] * stride_yn
            y_mask = row_mask[:, None] & (n < n_hi)[None, :]
            y = tl.load(y_ptrs, mask=y_mask, other=0.0)
            bt = tl.where(r_keep[:, None], bt, 0.0)
            acc = tl.sum(st[:, :, None] * bt[None, :, :].to(tl.float32), axis=1)  # [BLOCK_M, BLOCK_N]
            tl.store(y_ptrs, (y.to(tl.float32) + acc * scale).to(y.dtype), mask=y_mask)


@triton.jit
def _y_rows(y_ptr, toks, row_lo, seg_hi, n, n_stop, stride_yt, stride_yn, BLOCK_M: tl.constexpr):
    """Columns ``n`` (those below ``n_stop``) of y for each of the segment's rows, a tuple."""
    rows = ()
    for m in tl.static_range(BLOCK_M):
        n_end = tl.where(row_lo + m < seg_hi, n_stop, 0)  # no columns for a row past the segment
        rows = rows + (tl.load(y_ptr + toks[m] * stride_yt + n * stride_yn, mask=n < n_end, other=0.0),)
    return rows


@triton.jit
def _slice_columns(sl, off0, off1, off2, off3, off4):
    """Columns ``[n_lo, n_hi)`` of y that slice ``sl`` of a packed projection owns."""
    n_lo = tl.where(sl == 0, off0, tl.where(sl == 1, off1, tl.where(sl == 2, off2, off3)))
    n_hi = tl.where(sl == 0, off1, tl.where(sl == 1, off2, tl.where(sl == 2, off3, off4)))
    return n_lo, n_hi
