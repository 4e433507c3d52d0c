"""Fused mixture-of-experts experts in Triton: the CUDA path of ``dispatch.fused_moe``.

Same result as ``moe_torch.run_experts`` (each token's k experts' SwiGLU outputs, times the
routing weights, summed in fp32 and rounded once), in three steps that read nothing back to the
host:

1. ``align_pairs`` (torch ops with fixed output sizes) groups the (token, expert) pairs into row
   blocks of ``BLOCK_M``, one expert per block, each expert's pairs padded to a whole block
   (padding rows hold the id ``num_pairs``); the grid is the bound ``max_pair_blocks`` and a
   program whose block lies past ``num_padded`` (a device value it loads) returns at once.
2. ``_moe_gate_up_kernel``: one program per (block, column tile of I): its expert's gate and up
   weight tiles over the block's gathered token rows, fp32 accumulators, then
   ``SiLU(gate) * up`` written to ``act[pair]`` (the activation never goes through memory as
   gate and up).
3. ``_moe_down_kernel``: one program per (block, column tile of H) over ``act``'s rows of the
   block's pairs and its expert's ``down``, times the routing weight, written in fp32 to
   ``pair_out[pair]``; then a torch sum over each token's k rows, rounded once.

FP8 experts (``scales``, W8A16): each fp8 weight tile is upcast to the activations' dtype (exact)
before ``tl.dot``, and the fp32 accumulator is scaled: per row after the K loop (per-tensor and
per-channel scales), or per K tile inside it (block scales; the K tile divides the block's
columns, so a tile has one scale). Activations are never quantized. Where Triton has no e4m3
type (CUDA before sm_89) the kernels read the bytes and rebuild the values (``_fp8_values``).

With expert LoRA (``lora``), ``triton_moe_lora`` computes each pair's delta for gate_up before
step 2 and for down between steps 2 and 3; the kernels add them (``HAS_DELTA``) to the rounded
gate and up before the SiLU, and to the rounded down output before the routing weight.

The roundings follow the torch path's: gate and up are rounded to the model dtype, then the
SiLU and the product; the down output is rounded before the routing weight multiplies it (in
fp32 for Mixtral's fp32 weights; rounded again for the Qwen MoEs' model-dtype weights).

Row indices are int64 before they meet a stride; per-step counts are ``do_not_specialize``.
The grid comes from host ints only (T, k, E and the tile sizes), so the launches can be captured
in a CUDA graph and replayed for any routing of the same number of tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.moe_lora import ExpertLoRA
from loraplex.kernels.moe_torch import ExpertScales, PairBlocks, align_pairs
from loraplex.kernels.triton_moe_lora import expert_pair_slots, pair_lora_deltas


@triton.jit
def _fp8_values(tile, AS_BITS: tl.constexpr):
    """An fp8 e4m3 weight tile as values an exact ``.to(dtype)`` takes: the tile itself, or with
    ``AS_BITS`` (its raw bytes, uint8: Triton has no e4m3 before sm_89) fp16 values 256 times
    smaller, rebuilt from the bits (sign to bit 15, exponent and mantissa moved up 7: e4m3's
    bias is 8 below fp16's, its subnormals land on fp16's); ``FP8_UNIT`` scales make up for it.
    e4m3's NaN (S.1111.111, which the shift alone makes +-1.875, i.e. a finite 480 once scaled)
    becomes fp16's NaN, as torch's and the native path's conversions give."""
    # one return: compiled Triton requires every return of a function to have one type, even
    # one a constexpr branch leaves out (the interpreter does not check it)
    if AS_BITS:
        b = tile.to(tl.uint16)
        bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
        bits = tl.where((b & 0x7F) == 0x7F, bits | 0x7E00, bits)
        tile = bits.to(tl.float16, bitcast=True)
    return tile


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gate_up_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2 * I, H]: gate rows 0..I-1, up rows I..2I-1
    act_ptr,  # [P, I] model dtype: SiLU(gate) * up per pair
    sorted_ids_ptr,  # [max_blocks * BLOCK_M] int64
    block_expert_ptr,  # [max_blocks] int64
    num_padded_ptr,  # [1] int64
    num_pairs,
    top_k,
    hidden,
    inter,
    stride_xt,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_at,
    stride_ai,
    delta_ptr,  # [P, 2 * I] fp32 LoRA deltas (gate columns, then up); read only with HAS_DELTA
    stride_dp,
    stride_dn,
    scale_ptr,  # [E, 2 * I, groups] fp32 weight scales; read only with W_FP8
    stride_se,
    stride_sn,
    stride_sg,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # hidden % BLOCK_K == 0: no K mask, so loads vectorise
    HAS_DELTA: tl.constexpr,  # expert LoRA: add each pair's delta before the SiLU
    W_FP8: tl.constexpr,  # fp8 weights: each tile upcast to x's dtype, the scales applied in fp32
    SCALE_COLS: tl.constexpr,  # columns one scale covers (a multiple of BLOCK_K); 0: one per row
    AS_BITS: tl.constexpr,  # w_ptr holds the fp8 bytes as uint8, decoded in-kernel (_fp8_values)
    FP8_UNIT: tl.constexpr,  # 256.0 with AS_BITS, else 1.0: applied with the scales
):
    block = tl.program_id(0)
    n_tile = tl.program_id(1)
    row_lo = block.to(tl.int64) * BLOCK_M
    if row_lo >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + block)
    rows = row_lo + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + rows)  # int64
    valid = pair < num_pairs
    token = pair // top_k
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)

    x_rows = x_ptr + token[:, None] * stride_xt  # [BLOCK_M, 1]
    w_expert = w_ptr + expert * stride_we
    gate_rows = w_expert + offs_n[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    up_rows = w_expert + (offs_n + inter)[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    gate_scales = scale_ptr + expert * stride_se + offs_n.to(tl.int64) * stride_sn  # [BLOCK_N]
    up_scales = gate_scales + inter * stride_sn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + offs_k
        if EVEN_K:
            xt = tl.load(x_rows + k[None, :] * stride_xk, mask=valid[:, None], other=0.0)
            gt = tl.load(gate_rows + k[None, :] * stride_wk, mask=n_mask[:, None], other=0.0)
            ut = tl.load(up_rows + k[None, :] * stride_wk, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = k < hidden
            xt = tl.load(x_rows + k[None, :] * stride_xk, mask=valid[:, None] & k_mask[None, :], other=0.0)
            gt = tl.load(gate_rows + k[None, :] * stride_wk, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            ut = tl.load(up_rows + k[None, :] * stride_wk, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if W_FP8:  # W8A16: an exact upcast (e4m3 fits in bf16 / fp16), activations untouched
            gt = _fp8_values(gt, AS_BITS).to(xt.dtype)
            ut = _fp8_values(ut, AS_BITS).to(xt.dtype)
        if W_FP8 and SCALE_COLS > 0:  # block scales: this K tile lies in one scale group
            group = (k0 // SCALE_COLS) * stride_sg
            sg = tl.load(gate_scales + group, mask=n_mask, other=0.0) * FP8_UNIT
            su = tl.load(up_scales + group, mask=n_mask, other=0.0) * FP8_UNIT
            acc_gate += tl.dot(xt, tl.trans(gt)) * sg[None, :]
            acc_up += tl.dot(xt, tl.trans(ut)) * su[None, :]
        else:
            acc_gate += tl.dot(xt, tl.trans(gt))
            acc_up += tl.dot(xt, tl.trans(ut))
    if W_FP8 and SCALE_COLS == 0:  # one scale per row (per tensor or per channel)
        acc_gate *= (tl.load(gate_scales, mask=n_mask, other=0.0) * FP8_UNIT)[None, :]
        acc_up *= (tl.load(up_scales, mask=n_mask, other=0.0) * FP8_UNIT)[None, :]

    dtype = act_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)  # the torch path rounds each matmul's output
    up = acc_up.to(dtype).to(tl.float32)
    if HAS_DELTA:  # rounded base + fp32 delta, rounded again (moe_lora.add_pair_deltas)
        d_ptrs = delta_ptr + pair[:, None] * stride_dp + offs_n[None, :].to(tl.int64) * stride_dn
        d_mask = valid[:, None] & n_mask[None, :]
        gate = (gate + tl.load(d_ptrs, mask=d_mask, other=0.0)).to(dtype).to(tl.float32)
        up = (up + tl.load(d_ptrs + inter * stride_dn, mask=d_mask, other=0.0)).to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    act = (silu * up).to(dtype)
    act_ptrs = act_ptr + pair[:, None] * stride_at + offs_n[None, :] * stride_ai
    tl.store(act_ptrs, act, mask=valid[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_down_kernel(
    act_ptr,  # [P, I] model dtype
    w_ptr,  # [E, H, I]
    weight_ptr,  # [P] routing weights (fp32 or the model dtype)
    out_ptr,  # [P, H] fp32: each pair's weighted output
    sorted_ids_ptr,  # [max_blocks * BLOCK_M] int64
    block_expert_ptr,  # [max_blocks] int64
    num_padded_ptr,  # [1] int64
    num_pairs,
    hidden,
    inter,
    stride_at,
    stride_ai,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ot,
    stride_on,
    delta_ptr,  # [P, H] fp32 LoRA deltas; read only with HAS_DELTA
    stride_dp,
    stride_dn,
    scale_ptr,  # [E, H, groups] fp32 weight scales; read only with W_FP8
    stride_se,
    stride_sn,
    stride_sg,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # inter % BLOCK_K == 0
    ROUND_WEIGHTED: tl.constexpr,  # model-dtype routing weights: the product is rounded too
    HAS_DELTA: tl.constexpr,  # expert LoRA: add each pair's delta before the routing weight
    W_FP8: tl.constexpr,  # as in _moe_gate_up_kernel
    SCALE_COLS: tl.constexpr,
    AS_BITS: tl.constexpr,
    FP8_UNIT: tl.constexpr,
):
    block = tl.program_id(0)
    n_tile = tl.program_id(1)
    row_lo = block.to(tl.int64) * BLOCK_M
    if row_lo >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + block)
    rows = row_lo + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + rows)  # int64
    valid = pair < num_pairs
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)

    a_rows = act_ptr + pair[:, None] * stride_at  # [BLOCK_M, 1]
    w_rows = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    w_scales = scale_ptr + expert * stride_se + offs_n.to(tl.int64) * stride_sn  # [BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + offs_k
        if EVEN_K:
            at = tl.load(a_rows + k[None, :] * stride_ai, mask=valid[:, None], other=0.0)
            wt = tl.load(w_rows + k[None, :] * stride_wk, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = k < inter
            at = tl.load(a_rows + k[None, :] * stride_ai, mask=valid[:, None] & k_mask[None, :], other=0.0)
            wt = tl.load(w_rows + k[None, :] * stride_wk, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if W_FP8:
            wt = _fp8_values(wt, AS_BITS).to(at.dtype)
        if W_FP8 and SCALE_COLS > 0:
            scale = tl.load(w_scales + (k0 // SCALE_COLS) * stride_sg, mask=n_mask, other=0.0) * FP8_UNIT
            acc += tl.dot(at, tl.trans(wt)) * scale[None, :]
        else:
            acc += tl.dot(at, tl.trans(wt))
    if W_FP8 and SCALE_COLS == 0:
        acc *= (tl.load(w_scales, mask=n_mask, other=0.0) * FP8_UNIT)[None, :]

    dtype = act_ptr.dtype.element_ty
    routing = tl.load(weight_ptr + pair, mask=valid, other=0.0).to(tl.float32)  # [BLOCK_M]
    y = acc.to(dtype).to(tl.float32)
    if HAS_DELTA:
        d_ptrs = delta_ptr + pair[:, None] * stride_dp + offs_n[None, :].to(tl.int64) * stride_dn
        y = (y + tl.load(d_ptrs, mask=valid[:, None] & n_mask[None, :], other=0.0)).to(dtype).to(tl.float32)
    y = y * routing[:, None]
    if ROUND_WEIGHTED:
        y = y.to(dtype).to(tl.float32)
    out_ptrs = out_ptr + pair[:, None] * stride_ot + offs_n[None, :] * stride_on
    tl.store(out_ptrs, y, mask=valid[:, None] & n_mask[None, :])


def _delta_args(delta: torch.Tensor | None, placeholder: torch.Tensor) -> tuple:
    """(pointer, stride over pairs, stride over columns) of a delta, or a placeholder never read."""
    return (placeholder, 0, 0) if delta is None else (delta, delta.stride(0), delta.stride(1))


def _scale_args(scale: torch.Tensor | None, placeholder: torch.Tensor) -> tuple:
    """(pointer, strides over experts, rows and groups) of fp8 weights' scales, or a placeholder."""
    return (placeholder, 0, 0, 0) if scale is None else (scale, *scale.stride())


def scale_cols_and_k_tile(scale: torch.Tensor | None, block_cols: int | None, k_tile: int) -> tuple[int, int]:
    """``(SCALE_COLS, BLOCK_K)`` for weights whose scales are ``scale`` [E, rows, groups]: with one
    group a scale per row (0) and the K tile as chosen; with block scales a K tile that divides
    ``block_cols`` (a power of two, at least the 16 ``tl.dot`` takes), so each tile has one scale."""
    if scale is None or scale.shape[-1] == 1:
        return 0, k_tile
    tile = min(k_tile, block_cols & -block_cols)  # the largest power of two dividing block_cols
    if tile < 16:
        raise ValueError(f"fp8 experts with block scales of {block_cols} columns: the fused MoE kernels need "
                         "blocks of a multiple of 16 columns (Qwen3-FP8 and DeepSeek use 128)")
    return block_cols, tile


def native_e4m3_missing(device: torch.device) -> bool:
    """Whether Triton on ``device`` lacks the e4m3 type (CUDA before sm_89: A100, ...), so the kernels
    read fp8 weights as their bytes; the interpreter has it. A cached host query, no sync."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9)


def _pow2_tile(n: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(n)))


def moe_tiles(num_pairs: int, num_experts: int, hidden: int, inter: int) -> dict[str, int]:
    """Tile sizes from host ints. ``BLOCK_M`` follows the mean pairs per expert: decode batches
    give most experts one or two pairs, and a 16-row tile (the smallest ``tl.dot`` takes) wastes
    least; prefill-sized batches fill 64-row tiles and read each weight tile fewer times."""
    mean = num_pairs / num_experts
    block_m = 16 if mean <= 16 else 32 if mean <= 48 else 64
    # a one-token step has only k blocks: narrower column tiles give the GPU more programs
    # (Qwen3-30B-A3B: 8 x 24 for gate_up, 8 x 64 for down), as vLLM's untuned default does
    n_cap = 32 if block_m == 16 else 64
    return {
        "BLOCK_M": block_m,
        "gate_up_n": _pow2_tile(inter, n_cap),
        "gate_up_k": _pow2_tile(hidden, 64),
        "down_n": _pow2_tile(hidden, n_cap),
        "down_k": _pow2_tile(inter, 64),
    }


def fused_moe_triton(
    x: torch.Tensor,  # [T, H]
    weights: torch.Tensor,  # [T, k] routing weights (fp32, or x's dtype)
    experts: torch.Tensor,  # [T, k] int64 expert ids
    gate_up: torch.Tensor,  # [E, 2 * I, H]
    down: torch.Tensor,  # [E, H, I]
    *,
    blocks: PairBlocks | None = None,  # a prebuilt alignment (tests); else built here
    act: torch.Tensor | None = None,  # [T * k, I] x's dtype: scratch, else allocated here
    pair_out: torch.Tensor | None = None,  # [T * k, H] fp32: scratch, else allocated here
    lora: ExpertLoRA | None = None,  # the step's expert LoRA in this layer
    scales: ExpertScales | None = None,  # fp8 gate_up / down: their scales (W8A16)
    fp8_as_bits: bool | None = None,  # decode fp8 from its bytes in-kernel; None: where Triton lacks e4m3
) -> torch.Tensor:  # [T, H]
    """``dispatch.fused_moe`` on CUDA (or under the interpreter): align, then the two kernels
    (with ``lora``, each after its pairs' LoRA deltas: ``triton_moe_lora``; with ``scales``, fp8
    weight tiles upcast to x's dtype and scaled in the fp32 accumulator)."""
    num_tokens, hidden = x.shape
    top_k = experts.shape[1]
    num_experts, inter = gate_up.shape[0], down.shape[2]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    tiles = moe_tiles(num_pairs, num_experts, hidden, inter)
    if blocks is None:
        blocks = align_pairs(experts, num_experts, tiles["BLOCK_M"])
    block_m = blocks.block_m
    if act is None:
        act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    if pair_out is None:
        pair_out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    flat_weights = weights.reshape(-1)  # [P]
    common = (blocks.sorted_pair_ids, blocks.block_expert, blocks.num_padded, num_pairs)
    pair_slot = pair_expert = delta = None
    if lora is not None:
        pair_slot, pair_expert = expert_pair_slots(lora, top_k), experts.reshape(-1)
        delta = pair_lora_deltas(x, top_k, pair_slot, pair_expert, *lora.gate_up(), lora.slot_rank)  # [P, 2I] fp32
    block_cols = None if scales is None else scales.block_cols
    if scales is not None:
        if fp8_as_bits is None:
            fp8_as_bits = native_e4m3_missing(x.device)
        if fp8_as_bits:  # the same bytes, read as uint8 (_fp8_values)
            gate_up, down = gate_up.view(torch.uint8), down.view(torch.uint8)
    fp8 = {"W_FP8": scales is not None, "AS_BITS": bool(fp8_as_bits), "FP8_UNIT": 256.0 if fp8_as_bits else 1.0}
    gate_up_scale, down_scale = (None, None) if scales is None else (scales.gate_up, scales.down)
    n_tile = tiles["gate_up_n"]
    scale_cols, k_tile = scale_cols_and_k_tile(gate_up_scale, block_cols, tiles["gate_up_k"])
    _moe_gate_up_kernel[(blocks.max_blocks, triton.cdiv(inter, n_tile))](
        x, gate_up, act, *common, top_k, hidden, inter,
        x.stride(0), x.stride(1), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2),
        act.stride(0), act.stride(1), *_delta_args(delta, act), *_scale_args(gate_up_scale, act),
        BLOCK_M=block_m, BLOCK_N=n_tile, BLOCK_K=k_tile, EVEN_K=hidden % k_tile == 0, HAS_DELTA=delta is not None,
        SCALE_COLS=scale_cols, **fp8,
    )
    if lora is not None:
        delta = pair_lora_deltas(act, 1, pair_slot, pair_expert, *lora.down(), lora.slot_rank)  # [P, H] fp32
    n_tile = tiles["down_n"]
    scale_cols, k_tile = scale_cols_and_k_tile(down_scale, block_cols, tiles["down_k"])
    _moe_down_kernel[(blocks.max_blocks, triton.cdiv(hidden, n_tile))](
        act, down, flat_weights, pair_out, *common, hidden, inter,
        act.stride(0), act.stride(1), down.stride(0), down.stride(1), down.stride(2),
        pair_out.stride(0), pair_out.stride(1), *_delta_args(delta, pair_out), *_scale_args(down_scale, pair_out),
        BLOCK_M=block_m, BLOCK_N=n_tile, BLOCK_K=k_tile, EVEN_K=inter % k_tile == 0,
        ROUND_WEIGHTED=flat_weights.dtype != torch.float32, HAS_DELTA=delta is not None,
        SCALE_COLS=scale_cols, **fp8,
    )
    # each token's k rows summed in fp32, rounded once
    return pair_out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
