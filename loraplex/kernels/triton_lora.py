"""Segmented-gather LoRA kernels (SGMV shrink and expand) in Triton: the tile choice and the
launchers (the kernels are in ``triton_lora_shrink`` and ``triton_lora_expand``).

Same arguments and semantics as ``dispatch.lora_shrink`` / ``dispatch.lora_expand`` (and their
torch twins in ``lora_ref``). Tokens are grouped by adapter slot (``LoRABatchMeta``); one program
handles one tile of rows of one segment, so the grid follows the work present
(``num_segments x tiles of max_seg_len``), never ``max_loras x tokens``.

Two shapes of the same kernels, chosen per call from ``meta.max_seg_len`` (a host int):

* decode-shaped (segments of at most ``GEMV_MAX_SEG_LEN`` rows): a tensor-core tile is at least
  16 rows, so a one-token segment would waste 15/16 of it. These programs multiply on the CUDA
  cores (broadcast and ``tl.sum``), and shrink splits the ``in`` dimension across programs
  (split-K) so that a few segments still fill the GPU. Each split writes its own fp32 partial
  output and one small launch sums them in split order, so a step's result is the same on every
  run (fp32 atomics into one zeroed output, the other form kept for the lab, add in whatever
  order the splits finish: the H200 check of 2026-12-04 saw greedy tokens differ between two
  runs of the same batch).
  Each adapter's A and B tiles are read once per segment, which is the memory-roofline count.
* prefill-shaped (longer segments): ``tl.dot`` tiles of 16 to 64 rows.

Every slot's real rank bounds the work: shrink masks the rank tile beyond it (so ranks 1..15 and
odd ranks work in a 16-wide tile and masked rows of A are never fetched), expand loops over the
real rank in 16-wide chunks (reading at most 15 padding columns of B, selected away, so that the
loads stay 16 bytes wide). Row indices are widened to int64 before they meet a stride. Per-step counts are
``do_not_specialize`` so a new batch shape does not recompile, and nothing here reads a device
value on the host, so the launches can be captured in a CUDA graph (the grid comes from meta's
host ints; a graph runner passes upper bounds there, and empty segments exit at once; K splits
and column runs are sized by ``meta.sizing_segments``, the segments expected to hold rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from loraplex.kernels.lora_meta import LoRABatchMeta
from loraplex.kernels.triton_lora_expand import _sgmv_expand_gemv_kernel, _sgmv_expand_kernel
from loraplex.kernels.triton_lora_shrink import (
    GEMV_ACC,
    GEMV_REDUCE,
    GEMV_ROWS_X_RANK,
    _sgmv_shrink_kernel,
    _sum_partials_kernel,
)

# Longest segment the decode-shaped (no tl.dot) path takes; longer ones use tensor-core tiles.
GEMV_MAX_SEG_LEN = 8
# Largest rows x rank-tile product the decode-shaped shrink holds in registers without spilling.
GEMV_MAX_ROWS_X_RANK = 512
MAX_SLICES = 4  # packed projections: qkv has 3, gate_up 2
# how the decode-shaped shrink reduces: the kernel's GEMV constexpr (triton_lora_shrink.GEMV_*)
# ("dot": 16-row tensor-core tiles for decode segments too, the prefill path's kernel)
SHRINK_VARIANTS = {"reduce": GEMV_REDUCE.value, "acc": GEMV_ACC.value, "rows_x_rank": GEMV_ROWS_X_RANK.value,
                   "dot": 0}
DEFAULT_SHRINK_GEMV = "rows_x_rank"
# The decode-shaped expand: "rows" and "tiled" walk several column tiles per program (the whole
# rank in one tile, the next B tile loaded before this one is used), "rows" taking the segment's
# rows one by one, "tiled" all at once; "rows_ahead" is "rows" with every row's y loaded a tile
# ahead too; "plain" is one column tile per program, the rank in chunks; "dot" the prefill
# path's 16-row tensor-core tiles.
EXPAND_VARIANTS = ("rows", "tiled", "plain", "dot", "rows_ahead")
DEFAULT_EXPAND_GEMV = "rows"
# split-K partial outputs: at most this many splits, and splits x tokens at most PARTIAL_ROWS
# (the scratch of a prefill step stays near the size of one output without splits)
MAX_SPLIT_K = 32
PARTIAL_ROWS = 16384
SUM_TILE_ELEMENTS = 512  # [rows, rank] elements per program of the partials' sum
# how shrink's K splits are combined: "partials" (each split its own output, then summed in
# split order: deterministic) or "atomic" (fp32 atomics into one zeroed output)
SPLIT_REDUCTIONS = ("partials", "atomic")
DEFAULT_SPLIT_REDUCTION = "partials"
# where the partials are added: a launch of their own after the shrink ("launch"), or, in
# decode-shaped steps, by the expand as it loads each row's shrink output ("expand": one launch
# fewer per projection, and the sum never written to memory; the same fp32 additions in the same
# order, so the same bits)
SPLIT_SUMS = ("launch", "expand")


# the segment classes of the decode-shaped path (longest segment rounded up to a power of two)
DECODE_SEG_CLASSES = (1, 2, 4, 8)


def decode_seg_class_index(max_seg_len: int) -> int:
    """Index into ``DECODE_SEG_CLASSES`` of a step's longest segment (longer ones: the last)."""
    return min(len(DECODE_SEG_CLASSES) - 1, (max(1, max_seg_len) - 1).bit_length())


@dataclass(frozen=True)
class GemvTuning:
    """How the decode-shaped kernels run (``kernels/tune_lora.py`` times alternatives on a GPU):
    the variant per segment class, programs each launch aims for, elements of the register
    tiles, warps per program, the dot shrink's pipeline, where split-K partials are added."""

    # The defaults are what --tune-lora chose on an H200 on 2026-12-04 (kernels/RESULTS.md, call
    # 4), the setting that call's end-to-end rows ran: per segment class the fastest correct
    # variant on its decode cases (class 8 was not among them and keeps the earlier defaults),
    # then the launch sizes with them. The dot pipeline and split_sum came later: their defaults
    # are what that call ran, until a GPU call has timed the others.
    # programs per launch: a few waves over the 132 SMs of an H100/H200, fixed so the choice
    # needs no device query; the shrink's K split grows until about this many
    shrink_programs: int = 384
    shrink_tile_elements: int = 4096  # rows_x_rank's [rows x rank, K] tile
    expand_programs: int = 512  # column tiles are grouped down to about this many
    expand_tile_elements: int = 4096  # "rows": [columns, rank] tile; "tiled": [rows, rank, columns]
    shrink_num_warps: int = 4
    expand_num_warps: int = 4
    # the "dot" shrink of decode segments: x and A elements per pipeline stage (sets the K tile)
    # and the stages in flight (3: Triton's default)
    shrink_dot_stage_elements: int = 8192
    shrink_dot_num_stages: int = 3
    # the variant (SHRINK_VARIANTS / EXPAND_VARIANTS) for each of DECODE_SEG_CLASSES
    shrink_gemv: tuple[str, ...] = ("rows_x_rank", "dot", "dot", DEFAULT_SHRINK_GEMV)
    expand_gemv: tuple[str, ...] = ("rows_ahead", "rows_ahead", "rows_ahead", DEFAULT_EXPAND_GEMV)
    split_sum: str = "launch"  # SPLIT_SUMS: where the shrink's split-K partials are added

    def __post_init__(self) -> None:
        if self.split_sum not in SPLIT_SUMS:
            raise ValueError(f"split_sum must be one of {SPLIT_SUMS}, got {self.split_sum!r}")
        for name, chosen, known in (("shrink_gemv", self.shrink_gemv, SHRINK_VARIANTS),
                                    ("expand_gemv", self.expand_gemv, EXPAND_VARIANTS)):
            if len(chosen) != len(DECODE_SEG_CLASSES) or any(g not in known for g in chosen):
                raise ValueError(f"{name} names one of {tuple(known)} for each segment class "
                                 f"{DECODE_SEG_CLASSES}, got {chosen!r}")

    def shrink_gemv_for(self, max_seg_len: int) -> str:
        return self.shrink_gemv[decode_seg_class_index(max_seg_len)]

    def expand_gemv_for(self, max_seg_len: int) -> str:
        return self.expand_gemv[decode_seg_class_index(max_seg_len)]


DEFAULT_TUNING = GemvTuning()


def max_shrink_partials(num_tokens: int) -> int:
    """How many K-split partial outputs a shrink scratch for ``num_tokens`` rows holds."""
    return max(1, min(MAX_SPLIT_K, PARTIAL_ROWS // max(1, num_tokens)))


def _sizing_segments(meta: LoRABatchMeta) -> int:
    return meta.num_segments if meta.sizing_segments is None else max(1, min(meta.num_segments, meta.sizing_segments))


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, triton.next_power_of_2(max(1, n)))


def _row_tile(max_seg_len: int) -> tuple[int, bool]:
    """Rows per program and whether to use tensor-core tiles, from the longest segment."""
    if max_seg_len <= GEMV_MAX_SEG_LEN:
        return _pow2_at_least(max_seg_len, 1), False
    return min(64, _pow2_at_least(max_seg_len, 16)), True


def _is_decode_dot(max_seg_len: int, max_rank: int, gemv: str) -> bool:
    """Whether the shrink runs decode segments in 16-row tensor-core tiles because ``gemv`` says
    "dot" (not because the segments are long, nor as the large-rank fallback)."""
    block_m, use_dot = _row_tile(max_seg_len)
    return gemv == "dot" and not use_dot and block_m * _pow2_at_least(max_rank, 16) <= GEMV_MAX_ROWS_X_RANK


def shrink_tiles(
    max_seg_len: int, max_rank: int, gemv: str = DEFAULT_SHRINK_GEMV, tile_elements: int = 4096,
    dot_stage_elements: int = 8192,
) -> dict[str, int | bool]:
    """The shrink kernel's constexprs for a step's segment shape (also enumerated by the lab's
    ahead-of-time compile check); ``gemv`` names the decode-shaped reduction (SHRINK_VARIANTS)."""
    block_m, use_dot = _row_tile(max_seg_len)
    block_r = _pow2_at_least(max_rank, 16)
    if _is_decode_dot(max_seg_len, max_rank, gemv):
        # decode segments in 16-row tensor-core tiles: most rows are padding (never loaded), but
        # the MMA costs nothing here and the K loop's loads are pipelined through shared memory
        # (cp.async stages), so more bytes are in flight than registers alone hold; at most
        # dot_stage_elements of x and A per stage (8192: 16 KB in bf16)
        block_k = max(32, min(1024, triton.next_power_of_2(dot_stage_elements // (16 + block_r) + 1) // 2))
        return dict(BLOCK_M=16, BLOCK_R=block_r, BLOCK_K=block_k, USE_DOT=True, GEMV=0)
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
    if not use_dot and gemv in ("rows", "tiled", "rows_ahead"):
        block_r = _pow2_at_least(max_rank, 16)
        if block_m * block_r <= GEMV_MAX_ROWS_X_RANK:
            # the whole rank in one tile; the [(rows,) rank, columns] products bounded as in shrink
            # (rows_ahead also holds two tiles of y for each row: at most 4 rows a full tile)
            rows, ahead = gemv != "tiled", gemv == "rows_ahead"
            per_column = block_m * block_r if not rows else max(block_r, 4 * block_m) if ahead else block_r
            block_n = max(16, min(256, tile_elements // per_column))
            return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, ROWS=rows, AHEAD=ahead, GEMV_TILED=True)
        block_m, use_dot = 16, True
    if gemv == "dot" and not use_dot:
        block_m, use_dot = 16, True
    # rank in chunks of 16: a tensor-core K step, and at most 15 columns read past a real rank
    block_n = 64 if use_dot or block_m > 2 else 128
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=16, USE_DOT=use_dot, GEMV_TILED=False)


def shrink_split_k(
    in_features: int,
    num_slices: int,
    meta: LoRABatchMeta,
    max_partials: int,  # the partial outputs the scratch holds (ignored by "atomic")
    *,
    split_k: int | None = None,
    gemv: str | None = None,
    tuning: GemvTuning | None = None,
    split_reduction: str = DEFAULT_SPLIT_REDUCTION,
) -> int:
    """How many K splits ``lora_shrink_triton`` launches with these arguments (each whole K
    blocks, none empty)."""
    return _shrink_plan(in_features, num_slices, meta, max_partials, split_k, gemv, tuning, split_reduction)[1]


def _shrink_plan(
    in_features: int, num_slices: int, meta: LoRABatchMeta, max_partials: int, split_k: int | None,
    gemv: str | None, tuning: GemvTuning | None, split_reduction: str,
) -> tuple[dict[str, int | bool], int, int]:
    """The shrink kernel's constexprs, its K split (see ``shrink_split_k``) and K blocks per split."""
    if split_reduction not in SPLIT_REDUCTIONS:
        raise ValueError(f"split_reduction must be one of {SPLIT_REDUCTIONS}, got {split_reduction!r}")
    tuning = tuning or DEFAULT_TUNING
    gemv = tuning.shrink_gemv_for(meta.max_seg_len) if gemv is None else gemv
    tiles = shrink_tiles(meta.max_seg_len, meta.max_rank, gemv, tuning.shrink_tile_elements,
                         tuning.shrink_dot_stage_elements)
    programs = _sizing_segments(meta) * triton.cdiv(meta.max_seg_len, tiles["BLOCK_M"]) * num_slices
    k_blocks = triton.cdiv(in_features, tiles["BLOCK_K"])
    partials = split_reduction == "partials"
    if split_k is None:
        # split K only while each split keeps at least 4 K-blocks of work
        split_k = min(triton.cdiv(tuning.shrink_programs, programs), k_blocks // 4)
        if partials:
            split_k = min(split_k, max_partials)
    elif partials and split_k > max_partials:
        raise ValueError(f"{split_k} K splits need as many partial outputs; the scratch holds {max_partials}")
    split_k = max(1, min(split_k, k_blocks))
    k_blocks_per_split = triton.cdiv(k_blocks, split_k)
    return tiles, triton.cdiv(k_blocks, k_blocks_per_split), k_blocks_per_split


def lora_shrink_triton(
    x: torch.Tensor,  # [num_tokens, in]
    a_stack: torch.Tensor,  # [num_slices, max_loras, r_max, in]
    meta: LoRABatchMeta,
    out: torch.Tensor,  # [max_partials, num_slices, num_tokens, r_max] fp32 (3D: one), permuted rows
    *,
    split_k: int | None = None,  # override the K split (tests, tuning); None = by work present
    slot_rank: torch.Tensor | None = None,  # [max_loras] int32: ranks to use instead of meta's
    gemv: str | None = None,  # the decode-shaped reduction (SHRINK_VARIANTS); None = the tuning's for this step
    tuning: GemvTuning | None = None,  # None = DEFAULT_TUNING
    split_reduction: str = DEFAULT_SPLIT_REDUCTION,  # SPLIT_REDUCTIONS (the lab times both)
) -> torch.Tensor:  # [num_slices, num_tokens, r_max]: out[0], the result for expand (or see below)
    """``out[0][s, i, :r] = x[token_perm[i]] @ a_stack[s, slot, :r].T`` (see dispatch.lora_shrink);
    the other partial outputs of ``out`` hold K splits' partial sums on the way. With the
    tuning's ``split_sum == "expand"``, more than one split and decode-shaped segments, the
    partials are left unsummed and returned, ``out[:split_k]`` [splits, num_slices, num_tokens,
    r_max]: expand adds them."""
    if out.dim() == 3:
        out = out.unsqueeze(0)
    if meta.num_segments == 0 or meta.max_rank <= 0 or meta.max_seg_len == 0:
        return out[0]
    num_slices, _, _, in_features = a_stack.shape
    tuning = tuning or DEFAULT_TUNING
    gemv = tuning.shrink_gemv_for(meta.max_seg_len) if gemv is None else gemv
    tiles, split_k, k_blocks_per_split = _shrink_plan(in_features, num_slices, meta, out.shape[0], split_k, gemv,
                                                      tuning, split_reduction)
    block_k = tiles["BLOCK_K"]
    tiles_per_seg = triton.cdiv(meta.max_seg_len, tiles["BLOCK_M"])
    atomic = split_reduction == "atomic" and split_k > 1
    if atomic:
        out[0].zero_()  # the splits add into it
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
        0 if atomic else out.stride(0),
        *out.stride()[1:],
        **tiles,
        ATOMIC=atomic,
        EVEN_K=in_features % block_k == 0,
        num_warps=4 if tiles["USE_DOT"] else tuning.shrink_num_warps,
        **({"num_stages": tuning.shrink_dot_num_stages} if _is_decode_dot(meta.max_seg_len, meta.max_rank, gemv)
           else {}),
    )
    if split_k > 1 and not atomic:
        if tuning.split_sum == "expand" and meta.max_seg_len <= GEMV_MAX_SEG_LEN:
            # decode-shaped steps only: in the tensor-core expand of longer segments the partials'
            # loads stop the rank loop's cp.async pipelining (sm_90 SASS, Triton 3.6)
            return out[:split_k]  # lora_expand_triton adds them
        _sum_partials(out[:split_k])
    return out[0]


def _sum_partials(partials: torch.Tensor) -> None:  # [num_partials, num_slices, num_tokens, r_max] fp32
    """``partials[0] = partials[0] + partials[1] + ...``, in that order, for every row (rows no
    segment covers hold unspecified values and stay so)."""
    num_partials, num_slices, num_tokens, r_max = partials.shape
    block_r = _pow2_at_least(r_max, 16)
    block_t = max(1, SUM_TILE_ELEMENTS // block_r)
    grid = (triton.cdiv(num_tokens, block_t), num_slices)
    _sum_partials_kernel[grid](partials, num_tokens, r_max, num_partials, *partials.stride(),
                               BLOCK_T=block_t, BLOCK_R=block_r, EVEN_R=r_max == block_r)


def lora_expand_triton(
    shrunk: torch.Tensor,  # [num_slices, num_tokens, r_max] fp32, or [splits, ...] partials to add
    b_stack: torch.Tensor,  # [max_loras, out_total, r_max]
    scaling: torch.Tensor,  # [num_slices, max_loras] fp32
    slice_offsets: tuple[int, ...],  # num_slices + 1 offsets into out_total
    meta: LoRABatchMeta,
    y: torch.Tensor,  # [num_tokens, out_total], updated in place
    *,
    slot_rank: torch.Tensor | None = None,  # [max_loras] int32: ranks to use instead of meta's
    gemv: str | None = None,  # the decode-shaped kernel (EXPAND_VARIANTS); None = the tuning's for this step
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
    gemv = tuning.expand_gemv_for(meta.max_seg_len) if gemv is None else gemv
    tiles = expand_tiles(meta.max_seg_len, meta.max_rank, gemv, tuning.expand_tile_elements)
    partials = shrunk.dim() == 4  # the shrink's split-K partials, added here (split_sum "expand")
    num_partials, stride_sp = (shrunk.shape[0], shrunk.stride(0)) if partials else (1, 0)
    s_rows = shrunk[0] if partials else shrunk  # [num_slices, num_tokens, r_max]
    common = (
        shrunk, b_stack, scaling, y, meta.token_perm, meta.seg_starts, meta.seg_slot,
        meta.slot_rank if slot_rank is None else slot_rank,
    )
    strides = (*s_rows.stride(), *b_stack.stride(), *scaling.stride(), *y.stride(), num_partials, stride_sp)
    if tiles.pop("GEMV_TILED"):
        # group column tiles into programs until about tuning.expand_programs remain: each
        # program then pays its metadata loads once for many tiles (the grid stays sized by the
        # segments listed; a graph runner's upper bound only adds programs that exit at once,
        # and its sizing_segments keeps the runs as short as an eager step's)
        n_blocks = triton.cdiv(max_width, tiles["BLOCK_N"])
        if n_tiles is None:
            n_tiles = _sizing_segments(meta) * num_slices * n_blocks // tuning.expand_programs
        n_tiles = max(1, min(n_blocks, n_tiles))
        grid = (meta.num_segments, triton.cdiv(n_blocks, n_tiles), num_slices)
        _sgmv_expand_gemv_kernel[grid](
            *common, n_tiles, *offsets, *strides, **tiles,
            R_EVEN=s_rows.shape[2] % 16 == 0 and b_stack.shape[2] % 16 == 0, SUM_PARTIALS=partials,
            num_warps=tuning.expand_num_warps,
        )
        return
    tiles_per_seg = triton.cdiv(meta.max_seg_len, tiles["BLOCK_M"])
    grid = (meta.num_segments * tiles_per_seg, triton.cdiv(max_width, tiles["BLOCK_N"]), num_slices)
    _sgmv_expand_kernel[grid](
        *common, tiles_per_seg, *offsets, *strides, **tiles,
        R_EVEN=s_rows.shape[2] % tiles["BLOCK_R"] == 0 and b_stack.shape[2] % tiles["BLOCK_R"] == 0,
        SUM_PARTIALS=partials, num_warps=4,
    )
