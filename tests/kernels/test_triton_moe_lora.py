"""Expert LoRA in the fused MoE kernels (``triton_moe_lora`` + ``triton_moe``'s ``HAS_DELTA``) under
the interpreter, float16 and float32: the per-pair deltas against a float64 loop over pairs; the
whole experts block with LoRA against the torch path (``run_experts(..., lora)``) and against a
float64 per-token loop with each expert's ``W + scaling * B @ A`` merged per adapter. Ragged on
purpose: base-only tokens (slot -1), slots whose adapter has no expert LoRA, ranks 1, 3, 8 and 16
in one stack (NaN past each slot's rank: never read), experts no pair picks, experts without LoRA
inside an adapter; outputs and scratch NaN-poisoned; the launch path reads nothing back to the
host. Small shapes: the interpreter is slow."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.moe_lora import ExpertLoRA, token_slots_from_meta
from loraplex.kernels.moe_torch import run_experts
from loraplex.kernels.triton_moe import fused_moe_triton
from loraplex.kernels.triton_moe_lora import pair_lora_deltas
from tests.kernels.helpers import make_meta, rel_err
from tests.kernels.test_no_host_sync import trap_host_reads
from tests.kernels.test_triton_moe import make_case

HIDDEN, INTER, NUM_EXPERTS, R = 40, 24, 6, 16
SLOT_RANKS = [1, 3, 8, 16]  # slot s's adapter has this rank (zero rows and columns past it)


def make_lora(seed: int, dtype: torch.dtype, token_slot: list[int], no_lora_slot: int | None = None) -> ExpertLoRA:
    """Stacks for ``len(SLOT_RANKS)`` slots; expert 1 has no LoRA in slot 2 (scaling 0, zeros);
    ``no_lora_slot``: that slot's adapter has no expert LoRA at all (its pairs are base-only)."""
    gen = torch.Generator().manual_seed(seed)
    n, e = len(SLOT_RANKS), NUM_EXPERTS

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.5

    a_gu, b_gu = rand(2, n, e, R, HIDDEN), rand(n, e, 2 * INTER, R)
    a_dn, b_dn = rand(n, e, R, INTER), rand(n, e, HIDDEN, R)
    s_gu, s_dn = rand(2, n, e).abs() + 0.25, rand(n, e).abs() + 0.25
    for slot, rank in enumerate(SLOT_RANKS):  # past a slot's rank: never read (NaN would show)
        a_gu[:, slot, :, rank:] = float("nan")
        b_gu[slot, :, :, rank:] = float("nan")
        a_dn[slot, :, rank:] = float("nan")
        b_dn[slot, :, :, rank:] = float("nan")
    a_gu[:, 2, 1], b_gu[2, 1], a_dn[2, 1], b_dn[2, 1], s_gu[:, 2, 1], s_dn[2, 1] = 0, 0, 0, 0, 0, 0
    slots = torch.tensor([-1 if s == no_lora_slot else s for s in token_slot], dtype=torch.int64)
    return ExpertLoRA(slots, a_gu.to(dtype), b_gu.to(dtype), s_gu, a_dn.to(dtype), b_dn.to(dtype), s_dn,
                      torch.tensor(SLOT_RANKS, dtype=torch.int32))


def per_token_loop_with_lora(x, weights, experts, gate_up, down, lora: ExpertLoRA) -> torch.Tensor:
    """float64: each token's experts with the token's adapter merged into their weights."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        slot = int(lora.token_slot[t])
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            w_gu, w_dn = gate_up[e].double(), down[e].double()
            if slot >= 0:
                r = SLOT_RANKS[slot]
                s = lora.scaling_gate_up[:, slot, e].double()
                b = lora.b_gate_up[slot, e, :, :r].double()
                w_gu = w_gu + torch.cat([s[0] * b[:INTER] @ lora.a_gate_up[0, slot, e, :r].double(),
                                         s[1] * b[INTER:] @ lora.a_gate_up[1, slot, e, :r].double()])
                w_dn = w_dn + lora.scaling_down[slot, e].double() * lora.b_down[slot, e, :, :r].double() @ \
                    lora.a_down[slot, e, :r].double()
            gate, up = (w_gu @ x[t].double()).chunk(2)
            out[t] += float(weights[t, j]) * (w_dn @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pair_deltas_against_a_float64_loop(dtype):
    gen = torch.Generator().manual_seed(3)
    token_slot = [0, -1, 3, 2, 1, -1, 3]
    lora = make_lora(4, dtype, token_slot)
    top_k = 2
    x = torch.randn(len(token_slot), HIDDEN, generator=gen).to(dtype)
    pair_expert = torch.tensor([0, 1, 1, 5, 5, 0, 1, 3, 0, 1, 5, 0, 3, 1])  # experts 2 and 4: no pair
    pair_slot = lora.token_slot.repeat_interleave(top_k)
    out = torch.full((len(pair_expert), 2 * INTER), float("nan"))
    u = torch.full((len(pair_expert), 2, R), float("nan"))
    got = pair_lora_deltas(x, top_k, pair_slot, pair_expert, *lora.gate_up(), lora.slot_rank, out=out, u=u)
    want = torch.zeros(len(pair_expert), 2 * INTER, dtype=torch.float64)
    for p, (slot, e) in enumerate(zip(pair_slot.tolist(), pair_expert.tolist())):
        if slot < 0:
            continue
        r = SLOT_RANKS[slot]
        for j in range(2):
            a = lora.a_gate_up[j, slot, e, :r].double()
            shrunk = lora.scaling_gate_up[j, slot, e].double() * (a @ x[p // top_k].double())
            want[p, j * INTER:(j + 1) * INTER] = lora.b_gate_up[slot, e, j * INTER:(j + 1) * INTER, :r].double() @ shrunk
    assert not got.isnan().any()
    assert torch.equal(got[pair_slot < 0], torch.zeros_like(got[pair_slot < 0]))
    assert rel_err(got, want) < (1e-6 if dtype == torch.float32 else 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("style", ["mixtral", "qwen"])
@pytest.mark.parametrize("num_tokens, top_k", [(1, 2), (9, 2), (13, 1)])
def test_fused_moe_with_lora_against_torch_path_and_merged_loop(num_tokens, top_k, style, dtype):
    x, weights, experts, gate_up, down = make_case(num_tokens * 7 + top_k, num_tokens, NUM_EXPERTS, top_k, dtype,
                                                   style, hidden=HIDDEN, inter=INTER)
    token_slot = [(t % 6) - 1 if t % 6 < 5 else -1 for t in range(num_tokens)]  # -1, 0..3, -1, ...
    lora = make_lora(num_tokens, dtype, token_slot, no_lora_slot=1)
    pairs = num_tokens * top_k
    act = torch.full((pairs, INTER), float("nan"), dtype=dtype)
    pair_out = torch.full((pairs, HIDDEN), float("nan"))
    got = fused_moe_triton(x, weights, experts, gate_up, down, act=act, pair_out=pair_out, lora=lora)
    torch_path = run_experts(x, weights, experts, gate_up, down, lora)
    loop = per_token_loop_with_lora(x, weights, experts, gate_up, down, lora)
    base = run_experts(x, weights, experts, gate_up, down)
    lora_rows = lora.token_slot >= 0
    if lora_rows.any():  # the adapters change those tokens' outputs, not the others'
        assert rel_err(got[lora_rows], base[lora_rows]) > 1e-2
    assert torch.equal(torch_path[~lora_rows], base[~lora_rows])
    if dtype == torch.float32:
        assert rel_err(got, loop) < 1e-5 and rel_err(torch_path, loop) < 1e-5
        assert torch.allclose(got, torch_path, rtol=1e-5, atol=1e-5)
    else:
        assert rel_err(got, loop) < 3e-3
        assert rel_err(got, torch_path) < 1e-3


def test_launch_with_lora_reads_nothing_on_the_host():
    x, weights, experts, gate_up, down = make_case(5, 5, NUM_EXPERTS, 2, torch.float32, "qwen",
                                                   hidden=HIDDEN, inter=INTER)
    lora = make_lora(6, torch.float32, [3, -1, 0, 2, 2])
    with trap_host_reads() as calls:
        got = fused_moe_triton(x, weights, experts, gate_up, down, lora=lora)
    assert calls == []
    assert rel_err(got, per_token_loop_with_lora(x, weights, experts, gate_up, down, lora)) < 1e-5


def test_token_slots_from_the_step_metadata():
    """Each token's slot back from the grouped metadata (empty segments, a base segment), -1 for
    base tokens and for slots whose adapter has no expert LoRA."""
    token_slots = [2, -1, 0, 2, 1, -1, 0, 2]
    meta = make_meta(token_slots, [4, 4, 4], empty_segments=1)
    active = torch.tensor([1, 0, 1], dtype=torch.int32)
    got = token_slots_from_meta(meta.token_perm, meta.seg_starts, meta.seg_slot, active)
    assert got.tolist() == [s if s >= 0 and active[s] else -1 for s in token_slots]
