"""Segmented-gather LoRA kernels (SGMV shrink and expand) in Triton.

Same arguments and semantics as ``dispatch.lora_shrink`` / ``dispatch.lora_expand`` (and their
torch twins in ``lora_ref``). Tokens are grouped by adapter slot (``LoRABatchMeta``); one program
handles one tile of rows of one segment, so the grid follows the work present
(``num_segments x tiles of max_seg_len``), never ``max_loras x tokens``.

Two shapes of the same kernels, chosen per call from ``meta.max_seg_len`` (a host int):

* decode-shaped (segments of at most ``GEMV_MAX_SEG_LEN`` rows): a tensor-core tile is at least
  16 rows, so a one-token segment would waste 15/16 of it. These programs multiply on the CUDA
  cores (broadcast and ``tl.sum``), and shrink splits the ``in`` dimension across programs
  (split-K, fp32 atomics into a zeroed output) so that a few segments still fill the GPU.
  Each adapter's A and B tiles are read once per segment, which is the memory-roofline count.
* prefill-shaped (longer segments): ``tl.dot`` tiles of 16 to 64 rows.

Every slot's real rank bounds the work: shrink masks the rank tile beyond it (so ranks 1..15 and
odd ranks work in a 16-wide tile and masked rows of A are never fetched), expand loops over the
real rank in 16-wide chunks (reading at most 15 padding columns of B, selected away, so that the
loads stay 16 bytes wide). Row indices are widened to int64 before they meet a stride. Per-step counts are
``do_not_specialize`` so a new batch shape does not recompile, and nothing here reads a device
value on the host, so the launches can be captured in a CUDA graph (the grid comes from meta's
host ints; a graph runner passes upper bounds there, and empty segments exit at once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplex.kernels.lora_meta import LoRABatchMeta

# Longest segment the decode-shaped (no tl.dot) path takes; longer ones use tensor-core tiles.
GEMV_MAX_SEG_LEN = 8
# Largest rows x rank-tile product the decode-shaped shrink holds in registers without spilling.
GEMV_MAX_ROWS_X_RANK = 512
# Aim for about this many programs per launch before splitting the shrink's K dimension:
# a few waves over the 132 SMs of an H100/H200, fixed so the choice needs no device query.
TARGET_PROGRAMS = 512
MAX_SLICES = 4  # packed projections: qkv has 3, gate_up 2
# How the decode-shaped shrink reduces on the CUDA cores (a constexpr of the kernel):
GEMV_REDUCE = tl.constexpr(0)  # a [rows, rank, K-block] product reduced over K in every iteration
GEMV_ACC = tl.constexpr(1)  # products summed element-wise over the K loop, reduced once; next block prefetched
GEMV_ROWS_X_RANK = tl.constexpr(2)  # (row, rank) pairs as the rows of one 2D tile; next block prefetched
SHRINK_VARIANTS = {"reduce": 0, "acc": 1, "rows_x_rank": 2}
DEFAULT_SHRINK_GEMV = "rows_x_rank"
# The decode-shaped expand: "rows" and "tiled" walk several column tiles per program (the whole
# rank in one tile, the next B tile loaded before this one is used), "rows" taking the segment's
# rows one by one, "tiled" all at once; "plain" is one column tile per program, the rank in chunks.
EXPAND_VARIANTS = ("rows", "tiled", "plain")
DEFAULT_EXPAND_GEMV = "rows"
EXPAND_TARGET_PROGRAMS = 1024


@dataclass(frozen=True)
class GemvTuning:
    """Launch sizes of the decode-shaped kernels (``kernels/tune_lora.py`` times alternatives on
    a GPU): programs each launch aims for, elements of the register tiles, warps per program."""

    shrink_programs: int = TARGET_PROGRAMS  # the K split grows until about this many programs
    shrink_tile_elements: int = 4096  # rows_x_rank's [rows x rank, K] tile
    expand_programs: int = EXPAND_TARGET_PROGRAMS  # column tiles are grouped down to about this many
    expand_tile_elements: int = 4096  # "rows": [columns, rank] tile; "tiled": [rows, rank, columns]
    shrink_num_warps: int = 4
    expand_num_warps: int = 4


DEFAULT_TUNING = GemvTuning()


@triton.jit(do_not_specialize=["tiles_per_seg", "k_blocks_per_split"])
def _sgmv_shrink_kernel(
    x_ptr,  # [num_tokens, in]
    a_ptr,  # [num_slices, max_loras, r_max, in]
    out_ptr,  # [num_slices, num_tokens, r_max] fp32, permuted rows
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
    stride_os,
    stride_ot,
    stride_or,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    ATOMIC: tl.constexpr,
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
            k = kb * BLOCK_K + offs_k
            if EVEN_K:
                xt = tl.load(x_rows + k[None, :] * stride_xk, mask=row_mask[:, None], other=0.0)
                at = tl.load(a_rows + k[None, :] * stride_ak, mask=r_mask[:, None], other=0.0)
            else:
                k_mask = k < in_features
                xt = tl.load(x_rows + k[None, :] * stride_xk, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                at = tl.load(a_rows + k[None, :] * stride_ak, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
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


# slice offsets stay specialised: they are per-module constants, and knowing they are multiples
# of 16 lets the y accesses vectorise
@triton.jit(do_not_specialize=["tiles_per_seg"])
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    USE_DOT: tl.constexpr,
    R_EVEN: tl.constexpr,  # r_max % BLOCK_R == 0: rank chunks need no bounds mask
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
            bt = tl.load(b_cols + r[:, None] * stride_br, mask=n_mask[None, :], other=0.0)
            st = tl.where(r_mask[None, :], st, 0.0)
            bt = tl.where(r_mask[:, None], bt, 0.0)
        else:
            st = tl.load(s_rows + r[None, :] * stride_sr, mask=row_mask[:, None] & r_mask[None, :], other=0.0)
            bt = tl.load(b_cols + r[:, None] * stride_br, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        if USE_DOT:
            acc += tl.dot(st.to(bt.dtype), bt)  # [BLOCK_M, BLOCK_N]
        else:
            acc += tl.sum(st[:, :, None] * bt[None, :, :].to(tl.float32), axis=1)

    y_ptrs = y_ptr + tok[:, None] * stride_yt + n[None, :] * stride_yn
    y_mask = row_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc * scale).to(y.dtype), mask=y_mask)


@triton.jit(do_not_specialize=["n_tiles"])
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
    BLOCK_M: tl.constexpr,  # >= the longest segment: one row tile per segment
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,  # >= the largest rank: the whole rank in one tile
    R_EVEN: tl.constexpr,  # r_max % 16 == 0: whole 16-wide rank chunks may be read
    ROWS: tl.constexpr,  # the segment's rows one at a time ("rows"), or all at once ("tiled")
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
    if ROWS:
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
def _slice_columns(sl, off0, off1, off2, off3, off4):
    """Columns ``[n_lo, n_hi)`` of y that slice ``sl`` of a packed projection owns."""
    n_lo = tl.where(sl == 0, off0, tl.where(sl == 1, off1, tl.where(sl == 2, off2, off3)))
    n_hi = tl.where(sl == 0, off1, tl.where(sl == 1, off2, tl.where(sl == 2, off3, off4)))
    return n_lo, n_hi


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, triton.next_power_of_2(max(1, n)))


def _row_tile(max_seg_len: int) -> tuple[int, bool]:
    """Rows per program and whether to use tensor-core tiles, from the longest segment."""
    if max_seg_len <= GEMV_MAX_SEG_LEN:
        return _pow2_at_least(max_seg_len, 1), False
    return min(64, _pow2_at_least(max_seg_len, 16)), True


def shrink_tiles(
    max_seg_len: int, max_rank: int, gemv: str = DEFAULT_SHRINK_GEMV, tile_elements: int = 4096
) -> dict[str, int | bool]:
    """The shrink kernel's constexprs for a step's segment shape (also enumerated by the lab's
    ahead-of-time compile check); ``gemv`` names the decode-shaped reduction (SHRINK_VARIANTS)."""
    block_m, use_dot = _row_tile(max_seg_len)
    block_r = _pow2_at_least(max_rank, 16)
    if not use_dot and block_m * block_r > GEMV_MAX_ROWS_X_RANK:
        # several tokens x a large rank: the broadcast product would spill registers (sm_90,
        # 8 x 128), and a 16-row tensor-core tile is at most half padding here
        block_m, use_dot = 16, True
    if use_dot:
        return dict(BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=64 if block_r <= 64 else 32, USE_DOT=True, GEMV=0)
    if gemv == "rows_x_rank" and block_m * block_r > 128:
        gemv = "acc"  # a [rows x rank, 16] tile and its prefetch spill registers past 128 rows
    mode = SHRINK_VARIANTS[gemv]
    # bound what the registers hold: the [rows, rank, K] products (reduce, acc) or the
    # [rows x rank, K] tile with its prefetched next block (rows_x_rank)
    budget = tile_elements if mode == SHRINK_VARIANTS["rows_x_rank"] else 8192
    block_k = max(16, min(256, budget // (block_m * block_r)))
    return dict(BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, USE_DOT=False, GEMV=mode)


def expand_tiles(
    max_seg_len: int, max_rank: int, gemv: str = DEFAULT_EXPAND_GEMV, tile_elements: int = 4096
) -> dict[str, int | bool]:
    """The expand kernel's constexprs for a step's segment shape. ``GEMV_TILED`` in the result
    selects the decode-shaped kernel that walks several column tiles per program."""
    block_m, use_dot = _row_tile(max_seg_len)
    if not use_dot and gemv in ("rows", "tiled"):
        block_r = _pow2_at_least(max_rank, 16)
        if block_m * block_r <= GEMV_MAX_ROWS_X_RANK:
            # the whole rank in one tile; the [(rows,) rank, columns] products bounded as in shrink
            rows = gemv == "rows"
            block_n = max(16, min(256, tile_elements // (block_r if rows else block_m * block_r)))
            return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, ROWS=rows, GEMV_TILED=True)
        block_m, use_dot = 16, True
    # rank in chunks of 16: a tensor-core K step, and at most 15 columns read past a real rank
    block_n = 64 if use_dot or block_m > 2 else 128
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=16, USE_DOT=use_dot, GEMV_TILED=False)


def lora_shrink_triton(
    x: torch.Tensor,  # [num_tokens, in]
    a_stack: torch.Tensor,  # [num_slices, max_loras, r_max, in]
    meta: LoRABatchMeta,
    out: torch.Tensor,  # [num_slices, num_tokens, r_max] fp32, permuted rows
    *,
    split_k: int | None = None,  # override the K split (tests, tuning); None = by work present
    slot_rank: torch.Tensor | None = None,  # [max_loras] int32: ranks to use instead of meta's
    gemv: str = DEFAULT_SHRINK_GEMV,  # the decode-shaped reduction (SHRINK_VARIANTS; the lab times each)
    tuning: GemvTuning | None = None,  # None = DEFAULT_TUNING
) -> None:
    """``out[s, i, :r] = x[token_perm[i]] @ a_stack[s, slot, :r].T`` (see dispatch.lora_shrink)."""
    if meta.num_segments == 0 or meta.max_rank <= 0 or meta.max_seg_len == 0:
        return
    num_slices, _, _, in_features = a_stack.shape
    tuning = tuning or DEFAULT_TUNING
    tiles = shrink_tiles(meta.max_seg_len, meta.max_rank, gemv, tuning.shrink_tile_elements)
    block_m, block_k = tiles["BLOCK_M"], tiles["BLOCK_K"]
    tiles_per_seg = triton.cdiv(meta.max_seg_len, block_m)
    programs = meta.num_segments * tiles_per_seg * num_slices
    k_blocks = triton.cdiv(in_features, block_k)
    if split_k is None:
        # split K only while each split keeps at least 4 K-blocks of work
        split_k = min(triton.cdiv(tuning.shrink_programs, programs), k_blocks // 4)
    split_k = max(1, min(split_k, k_blocks))
    k_blocks_per_split = triton.cdiv(k_blocks, split_k)
    split_k = triton.cdiv(k_blocks, k_blocks_per_split)
    if split_k > 1:
        out.zero_()  # the splits add into it
    grid = (meta.num_segments * tiles_per_seg, split_k, num_slices)
    _sgmv_shrink_kernel[grid](
        x,
        a_stack,
        out,
        meta.token_perm,
        meta.seg_starts,
        meta.seg_slot,
        meta.slot_rank if slot_rank is None else slot_rank,
        in_features,
        tiles_per_seg,
        k_blocks_per_split,
        x.stride(0),
        x.stride(1),
        *a_stack.stride(),
        *out.stride(),
        **tiles,
        ATOMIC=split_k > 1,
        EVEN_K=in_features % block_k == 0,
        num_warps=4 if tiles["USE_DOT"] else tuning.shrink_num_warps,
    )


def lora_expand_triton(
    shrunk: torch.Tensor,  # [num_slices, num_tokens, r_max] fp32
    b_stack: torch.Tensor,  # [max_loras, out_total, r_max]
    scaling: torch.Tensor,  # [num_slices, max_loras] fp32
    slice_offsets: tuple[int, ...],  # num_slices + 1 offsets into out_total
    meta: LoRABatchMeta,
    y: torch.Tensor,  # [num_tokens, out_total], updated in place
    *,
    slot_rank: torch.Tensor | None = None,  # [max_loras] int32: ranks to use instead of meta's
    gemv: str = DEFAULT_EXPAND_GEMV,  # the decode-shaped kernel (EXPAND_VARIANTS; the lab times each)
    n_tiles: int | None = None,  # "rows" / "tiled": column tiles per program (tests); None = by work present
    tuning: GemvTuning | None = None,  # None = DEFAULT_TUNING
) -> None:
    """``y[token_perm[i], slice s] += scaling[s, slot] * shrunk[s, i, :r] @ B_s[slot, :, :r].T``,
    every slice of a packed projection in one launch (see dispatch.lora_expand)."""
    if meta.num_segments == 0 or meta.max_rank <= 0 or meta.max_seg_len == 0:
        return
    num_slices = len(slice_offsets) - 1
    if not 1 <= num_slices <= MAX_SLICES:
        raise ValueError(f"lora_expand_triton supports 1..{MAX_SLICES} slices, got {num_slices}")
    offsets = list(slice_offsets) + [slice_offsets[-1]] * (MAX_SLICES + 1 - len(slice_offsets))
    max_width = max(slice_offsets[s + 1] - slice_offsets[s] for s in range(num_slices))
    tuning = tuning or DEFAULT_TUNING
    tiles = expand_tiles(meta.max_seg_len, meta.max_rank, gemv, tuning.expand_tile_elements)
    common = (
        shrunk, b_stack, scaling, y, meta.token_perm, meta.seg_starts, meta.seg_slot,
        meta.slot_rank if slot_rank is None else slot_rank,
    )
    strides = (*shrunk.stride(), *b_stack.stride(), *scaling.stride(), *y.stride())
    if tiles.pop("GEMV_TILED"):
        # group column tiles into programs until about tuning.expand_programs remain: each
        # program then pays its metadata loads once for many tiles (the grid stays sized by the
        # segments present; a graph runner's upper bound only adds programs that exit at once)
        n_blocks = triton.cdiv(max_width, tiles["BLOCK_N"])
        if n_tiles is None:
            n_tiles = meta.num_segments * num_slices * n_blocks // tuning.expand_programs
        n_tiles = max(1, min(n_blocks, n_tiles))
        grid = (meta.num_segments, triton.cdiv(n_blocks, n_tiles), num_slices)
        _sgmv_expand_gemv_kernel[grid](
            *common, n_tiles, *offsets, *strides, **tiles,
            R_EVEN=shrunk.shape[2] % 16 == 0 and b_stack.shape[2] % 16 == 0,
            num_warps=tuning.expand_num_warps,
        )
        return
    tiles_per_seg = triton.cdiv(meta.max_seg_len, tiles["BLOCK_M"])
    grid = (meta.num_segments * tiles_per_seg, triton.cdiv(max_width, tiles["BLOCK_N"]), num_slices)
    _sgmv_expand_kernel[grid](
        *common, tiles_per_seg, *offsets, *strides, **tiles,
        R_EVEN=shrunk.shape[2] % tiles["BLOCK_R"] == 0 and b_stack.shape[2] % tiles["BLOCK_R"] == 0,
        num_warps=4,
    )
