"""FP8 experts in the fused MoE kernels (W8A16: ``triton_moe``'s ``W_FP8``) under the interpreter,
float16 and float32 compute, with fp8 (``float8_e4m3fn``) weights: the kernels against a float64
per-token loop and the torch path over the same weights dequantized first by the test's own
quantizer (``tests/fixtures/fp8_checkpoints.quantize``), per tensor, per channel and per block
(16x16 and 32x32 blocks on tiny dims, ragged last blocks: H=96, I=72); NaN-poisoned scratch; with
expert LoRA; the CPU loop (``run_experts(..., scales)``) against the same reference; the launch
reading nothing back to the host. The interpreter loads fp8 and upcasts it exactly (checked first);
the byte decoding GPUs before sm_89 take (``fp8_as_bits``) runs the same cases and every byte."""

from __future__ import annotations

import pytest
import torch

import triton
import triton.language as tl

from loraplex.kernels.moe_torch import ExpertScales, run_experts
from loraplex.kernels.triton_moe import _fp8_values, fused_moe_triton
from tests.fixtures.fp8_checkpoints import FP8, quantize
from tests.kernels.helpers import rel_err
from tests.kernels.test_no_host_sync import trap_host_reads
from tests.kernels.test_triton_moe import HIDDEN, INTER, make_case, per_token_loop
from tests.kernels.test_triton_moe_lora import make_lora, per_token_loop_with_lora

HOW = {"tensor": ("tensor",), "channel": ("channel",), "block16": ("block", 16, 16), "block32": ("block", 32, 32)}


def _per_row(scale: torch.Tensor, how: tuple, out: int) -> torch.Tensor:
    """The stored scale in the kernels' per-row layout [out, groups] (the test's own expansion)."""
    if how[0] == "block":
        return scale.float().repeat_interleave(how[1], 0)[:out]
    return scale.float().reshape(-1, 1).expand(out, 1)


def quantize_experts(stacked: torch.Tensor, how: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(fp8 [E, out, in], scales [E, out, groups], dequantized fp32 [E, out, in])``, per expert."""
    q, s, d = zip(*(quantize(w, how, torch.float32) for w in stacked))
    return torch.stack(q), torch.stack([_per_row(x, how, stacked.shape[1]) for x in s]), torch.stack(d)


def fp8_case(seed, num_tokens, num_experts, top_k, dtype, style, how_name, hidden=HIDDEN, inter=INTER):
    x, weights, experts, gate_up, down = make_case(seed, num_tokens, num_experts, top_k, dtype, style,
                                                   hidden=hidden, inter=inter)
    how = HOW[how_name]
    gu_q, gu_s, gu_d = quantize_experts(gate_up.float(), how)
    dn_q, dn_s, dn_d = quantize_experts(down.float(), how)
    scales = ExpertScales(gu_s, dn_s, how[2] if how[0] == "block" else None)
    return x, weights, experts, (gu_q, dn_q, scales), (gu_d, dn_d)


def test_interpreter_loads_fp8_tiles_exactly():
    @triton.jit
    def upcast(w_ptr, out_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(out_ptr + offs, tl.load(w_ptr + offs).to(tl.float16))

    w = (torch.randn(64) * 100).to(FP8)
    out = torch.empty(64, dtype=torch.float16)
    upcast[(1,)](w, out, N=64)
    assert torch.equal(out, w.to(torch.float16))


@pytest.mark.parametrize("as_bits", [False, True], ids=["e4m3", "bytes"])  # bytes: GPUs before sm_89
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("how", sorted(HOW))
@pytest.mark.parametrize("num_tokens, num_experts, top_k, style", [(1, 4, 2, "qwen"), (17, 8, 2, "mixtral"),
                                                                   (5, 8, 1, "qwen")])
def test_fp8_experts_against_the_dequantized_reference(num_tokens, num_experts, top_k, style, how, dtype, as_bits):
    x, weights, experts, (gu_q, dn_q, scales), (gu_d, dn_d) = fp8_case(
        num_tokens * 31 + num_experts, num_tokens, num_experts, top_k, dtype, style, how)
    pairs = num_tokens * top_k
    act = torch.full((pairs, INTER), float("nan"), dtype=dtype)
    pair_out = torch.full((pairs, HIDDEN), float("nan"))
    got = fused_moe_triton(x, weights, experts, gu_q, dn_q, act=act, pair_out=pair_out, scales=scales,
                           fp8_as_bits=as_bits)
    assert got.dtype == dtype and not got.isnan().any()
    loop = per_token_loop(x, weights, experts, gu_d, dn_d)  # float64 on the dequantized weights
    cpu = run_experts(x, weights, experts, gu_q, dn_q, scales=scales)
    unquantized = per_token_loop(x, weights, experts, *make_case(
        num_tokens * 31 + num_experts, num_tokens, num_experts, top_k, dtype, style)[3:])
    assert rel_err(loop, unquantized) > 1e-2  # fp8 moves the output: a dropped scale would show
    if dtype == torch.float32:
        assert rel_err(got, loop) < 1e-5 and rel_err(cpu, loop) < 1e-5
    else:  # the kernel scales the fp32 accumulator; the reference rounds weight * scale to fp16 first
        assert rel_err(got, loop) < 3e-3
        assert rel_err(got, run_experts(x, weights, experts, gu_d.to(dtype), dn_d.to(dtype))) < 3e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("how", ["channel", "block16"])
def test_fp8_experts_with_expert_lora(how, dtype):
    from tests.kernels.test_triton_moe_lora import HIDDEN as H, INTER as I, NUM_EXPERTS as E

    num_tokens = 9
    x, weights, experts, (gu_q, dn_q, scales), (gu_d, dn_d) = fp8_case(
        3, num_tokens, E, 2, dtype, "qwen", how, hidden=H, inter=I)
    lora = make_lora(4, dtype, [(t % 6) - 1 if t % 6 < 5 else -1 for t in range(num_tokens)])
    got = fused_moe_triton(x, weights, experts, gu_q, dn_q, lora=lora, scales=scales)
    loop = per_token_loop_with_lora(x, weights, experts, gu_d, dn_d, lora)
    base = per_token_loop(x, weights, experts, gu_d, dn_d)
    assert rel_err(loop, base) > 1e-2  # the adapters matter
    cpu = run_experts(x, weights, experts, gu_q, dn_q, lora, scales)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert rel_err(got, loop) < tol and rel_err(cpu, loop) < tol


@triton.jit
def _decode_bytes(w_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, _fp8_values(tl.load(w_ptr + offs), True).to(tl.float32) * 256.0)


def test_fp8_bytes_decode_to_every_e4m3_value():
    """The byte decoding of GPUs without e4m3 (``_fp8_values``, then the 256 the scales carry)
    against torch's e4m3 for all 256 bytes but the two NaNs (subnormals, zeros and signs included)."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    padded = torch.zeros(256, dtype=torch.uint8)
    padded[: codes.numel()] = codes
    out = torch.empty(256)
    _decode_bytes[(1,)](padded, out, N=256)
    want = codes.view(FP8).float()
    assert torch.equal(out[: codes.numel()], want) and torch.equal(out[: codes.numel()].signbit(), want.signbit())


def test_fp8_nan_bytes_decode_to_nan():
    """e4m3's two NaN bytes (0x7F, 0xFF) are NaN through the byte decoding too, as torch's e4m3 (and
    the native path's upcast) makes them; the bit shift alone made them +-480 once scaled."""
    codes = torch.tensor([0x7F, 0xFF, 0x7E, 0xFE], dtype=torch.uint8)
    padded = torch.zeros(16, dtype=torch.uint8)
    padded[:4] = codes
    out = torch.empty(16)
    _decode_bytes[(1,)](padded, out, N=16)
    want = codes.view(FP8).float()
    assert want[:2].isnan().all() and out[:2].isnan().all()
    assert torch.equal(out[2:4], want[2:])  # the largest finite values, +-448, next to them


def test_fp8_launch_reads_nothing_on_the_host():
    x, weights, experts, (gu_q, dn_q, scales), (gu_d, dn_d) = fp8_case(9, 6, 8, 2, torch.float32, "qwen", "block16")
    with trap_host_reads() as calls:
        got = fused_moe_triton(x, weights, experts, gu_q, dn_q, scales=scales)
    assert calls == []
    assert rel_err(got, per_token_loop(x, weights, experts, gu_d, dn_d)) < 1e-5


def test_blocks_narrower_than_a_dot_tile_are_refused():
    x, weights, experts, (gu_q, dn_q, scales), _ = fp8_case(9, 2, 4, 2, torch.float32, "qwen", "block16")
    narrow = ExpertScales(gu_q.new_ones(gu_q.shape[0], gu_q.shape[1], 12, dtype=torch.float32),
                          dn_q.new_ones(dn_q.shape[0], dn_q.shape[1], 9, dtype=torch.float32), 8)
    with pytest.raises(ValueError, match="multiple of 16 columns"):
        fused_moe_triton(x, weights, experts, gu_q, dn_q, scales=narrow)
