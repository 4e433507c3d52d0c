"""The fused MoE kernels (``loraplex.kernels.triton_moe``) under the interpreter, float16 and
float32: the pair alignment against a python grouping; the kernels against the torch path
(``run_experts``) and against a float64 per-token loop, with fresh routings per case, both
routing-weight styles (Mixtral's fp32, the Qwen MoEs' model dtype) and NaN-poisoned scratch; the
whole launch path reading nothing back to the host."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from tests.kernels.helpers import rel_err
from tests.kernels.test_no_host_sync import trap_host_reads

from loraplex.kernels.moe_torch import align_pairs, max_pair_blocks, run_experts  # noqa: E402
from loraplex.kernels.triton_moe import fused_moe_triton, moe_tiles  # noqa: E402

# neither a multiple of the 64-wide K tiles: two K steps, the second masked; masked column tiles
HIDDEN, INTER = 96, 72


def python_blocks(experts: list[list[int]], num_experts: int, block_m: int) -> tuple[list[int], list[int]]:
    """(row pair ids, block experts) built by hand: each expert's pairs in pair order, padded
    with ``num_pairs`` to whole blocks, experts in id order."""
    flat = [e for row in experts for e in row]
    rows, block_expert = [], []
    for e in range(num_experts):
        pairs = [p for p, pe in enumerate(flat) if pe == e]
        n_blocks = math.ceil(len(pairs) / block_m)
        rows += pairs + [len(flat)] * (n_blocks * block_m - len(pairs))
        block_expert += [e] * n_blocks
    return rows, block_expert


@pytest.mark.parametrize(
    "experts, num_experts, block_m",
    [
        # expert 1 and 3 get nothing, expert 2 exactly one pair, expert 0 more than a block
        ([[0, 2], [0, 0], [0, 0], [0, 0], [0, 0], [0, 4]], 5, 4),
        ([[3]], 8, 16),  # one token: one block, 15 padding rows
        ([[e % 3, (e + 1) % 3] for e in range(40)], 3, 16),  # every expert past a block
        ([[7, 1]] * 16 + [[1, 7]] * 17, 8, 16),  # 33 pairs each: 3 blocks, padding in the last
    ],
)
def test_alignment_against_a_python_grouping(experts, num_experts, block_m):
    blocks = align_pairs(torch.tensor(experts), num_experts, block_m)
    rows, block_expert = python_blocks(experts, num_experts, block_m)
    num_pairs = len(experts) * len(experts[0])
    assert blocks.num_padded.tolist() == [len(rows)]
    assert blocks.sorted_pair_ids[: len(rows)].tolist() == rows
    assert blocks.block_expert[: len(block_expert)].tolist() == block_expert
    assert set(blocks.block_expert[len(block_expert) :].tolist()) <= {-1}  # blocks past the end
    assert set(blocks.sorted_pair_ids[len(rows) :].tolist()) <= {num_pairs}  # unused rows are padding
    # every pair exactly once; each block's real rows are its expert's pairs
    ids = blocks.sorted_pair_ids.tolist()
    assert sorted(i for i in ids if i < num_pairs) == list(range(num_pairs))
    flat = [e for row in experts for e in row]
    for b, e in enumerate(block_expert):
        assert all(flat[p] == e for p in ids[b * block_m : (b + 1) * block_m] if p < num_pairs)


def test_block_bound_holds_for_the_worst_routings():
    """``max_pair_blocks`` sizes the buffers and the grid: no routing may need more blocks (each
    expert one pair over a block, or every pair on its own expert)."""
    gen = torch.Generator().manual_seed(4)
    for num_tokens, k, num_experts, block_m in [(1, 8, 128, 16), (17, 2, 8, 16), (64, 2, 4, 16), (33, 4, 8, 4)]:
        routings = [torch.randint(0, num_experts, (num_tokens, k), generator=gen) for _ in range(20)]
        routings.append(torch.arange(num_tokens * k).reshape(num_tokens, k) % num_experts)
        routings.append(torch.arange(num_tokens * k).reshape(num_tokens, k) // (block_m + 1) % num_experts)
        for experts in routings:
            need = sum(math.ceil(c / block_m) for c in torch.bincount(experts.flatten()).tolist())
            assert need <= max_pair_blocks(num_tokens * k, num_experts, block_m)
            assert align_pairs(experts, num_experts, block_m).num_padded.item() == need * block_m


def make_case(seed: int, num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype, style: str,
              hidden: int = HIDDEN, inter: int = INTER):
    """x, routing weights and ids from random router logits, stacked expert weights."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype)
    probs = torch.softmax(torch.randn(num_tokens, num_experts, generator=gen) * 2, dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    if style == "qwen":  # the Qwen MoEs hand the experts model-dtype weights; Mixtral keeps fp32
        weights = weights.to(dtype)
    return x, weights, experts, gate_up, down


def per_token_loop(x, weights, experts, gate_up, down) -> torch.Tensor:  # [T, H] float64
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            gate, up = (gate_up[e].double() @ x[t].double()).chunk(2)
            out[t] += float(weights[t, j]) * (down[e].double() @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("style", ["mixtral", "qwen"])
@pytest.mark.parametrize("num_experts, top_k", [(4, 1), (4, 2), (8, 1), (8, 2)])
@pytest.mark.parametrize("num_tokens", [1, 3, 17, 64])
def test_fused_moe_against_torch_path_and_per_token_loop(num_tokens, num_experts, top_k, style, dtype):
    seed = zlib.crc32(repr((num_tokens, num_experts, top_k, style, dtype)).encode())  # its own per case
    x, weights, experts, gate_up, down = make_case(seed, num_tokens, num_experts, top_k, dtype, style)
    pairs = num_tokens * top_k
    act = torch.full((pairs, INTER), float("nan"), dtype=dtype)
    pair_out = torch.full((pairs, HIDDEN), float("nan"))
    got = fused_moe_triton(x, weights, experts, gate_up, down, act=act, pair_out=pair_out)
    assert got.dtype == dtype and got.shape == x.shape
    torch_path = run_experts(x, weights, experts, gate_up, down)
    loop = per_token_loop(x, weights, experts, gate_up, down)
    if dtype == torch.float32:
        assert rel_err(got, loop) < 1e-5 and rel_err(torch_path, loop) < 1e-5
        assert torch.allclose(got, torch_path, rtol=1e-5, atol=1e-6)
    else:  # the same roundings as the torch path: apart only by summation order inside a matmul
        assert rel_err(got, loop) < 2e-3
        assert rel_err(got, torch_path) < 5e-4


def test_fused_moe_with_blocks_of_several_experts_and_unpicked_ones():
    """Tokens pushed onto experts 0 and 5 of 8 (more than a block each, six experts unpicked),
    with a 16-row block while the launcher would pick another: the kernels follow the blocks.
    H=128, I=64: whole K tiles (the unmasked loads), two of them in gate_up."""
    x, weights, experts, gate_up, down = make_case(77, 40, 8, 2, torch.float32, "mixtral", hidden=128, inter=64)
    experts = torch.stack([torch.zeros(40, dtype=torch.int64), torch.full((40,), 5)], dim=1)
    blocks = align_pairs(experts, 8, 16)
    assert blocks.num_padded.item() == 2 * 48
    got = fused_moe_triton(x, weights, experts, gate_up, down, blocks=blocks)
    assert rel_err(got, per_token_loop(x, weights, experts, gate_up, down)) < 1e-5


def test_tiles_follow_pairs_per_expert():
    assert moe_tiles(8, 128, 2048, 768)["BLOCK_M"] == 16  # Qwen3-30B-A3B decode of one token
    assert moe_tiles(256 * 8, 128, 2048, 768)["BLOCK_M"] == 16  # 16 pairs per expert on average
    assert moe_tiles(4096 * 8, 128, 2048, 768)["BLOCK_M"] == 64
    decode, prefill = moe_tiles(8, 128, 2048, 768), moe_tiles(4096 * 8, 128, 2048, 768)
    assert (decode["gate_up_n"], decode["down_n"], prefill["gate_up_n"], prefill["down_n"]) == (32, 32, 64, 64)
    assert moe_tiles(24, 4, 32, 24)["down_k"] == 32  # never wider than the dimension's power of two


def test_launch_path_reads_nothing_on_the_host():
    """Alignment and both kernels: no device value read on the host (CUDA-graph capturable)."""
    for style in ("mixtral", "qwen"):
        x, weights, experts, gate_up, down = make_case(5, 9, 8, 2, torch.float32, style)
        with trap_host_reads() as calls:
            got = fused_moe_triton(x, weights, experts, gate_up, down)
        assert calls == []
        assert rel_err(got, per_token_loop(x, weights, experts, gate_up, down)) < 1e-5
