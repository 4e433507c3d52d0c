"""The batched CPU shrink/expand (what dispatch runs on CPU) against the torch reference
``lora_ref``: mixed real ranks, padding, base tokens, empty slots, 1-3 slices, fp32 and bf16."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.kernels.lora_cpu import lora_expand_cpu, lora_shrink_cpu
from loraplex.kernels.lora_ref import lora_expand_ref, lora_shrink_ref
from loraplex.lora.context import build_batch_meta


def _case(seed: int, dtype: torch.dtype, num_slices: int, num_tokens: int):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    max_loras, r_max, in_f = 12, 16, 24
    outs = [rng.randrange(4, 20) for _ in range(num_slices)]
    offsets = [0]
    for o in outs:
        offsets.append(offsets[-1] + o)
    ranks = [rng.choice([1, 8, 16]) for _ in range(max_loras)]
    ranks[4] = 0  # an empty slot, never referenced
    # gaps between used slots: evenly spaced, runs and gathered batches all occur
    slots = [rng.choice([-1, 0, 1, 2, 3, 5, 6, 8, 10, 11]) for _ in range(num_tokens)]
    meta = build_batch_meta(slots, torch.tensor(ranks, dtype=torch.int32), ranks)
    x = torch.randn(num_tokens, in_f).to(dtype)
    a = torch.randn(num_slices, max_loras, r_max, in_f).to(dtype)
    b = torch.randn(max_loras, offsets[-1], r_max).to(dtype)
    scaling = torch.rand(num_slices, max_loras) * 2
    y = torch.randn(num_tokens, offsets[-1]).to(dtype)
    return meta, x, a, b, scaling, tuple(offsets), y, slots, ranks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_slices", [1, 2, 3])
@pytest.mark.parametrize("num_tokens", [1, 7, 40, 300])  # 300: long segments run alone
def test_cpu_twin_matches_reference(dtype, num_slices, num_tokens):
    meta, x, a, b, scaling, offsets, y, slots, ranks = _case(num_tokens * 10 + num_slices, dtype, num_slices, num_tokens)
    shrunk_ref = torch.zeros(num_slices, num_tokens, a.shape[2])
    shrunk_cpu = torch.zeros_like(shrunk_ref)
    lora_shrink_ref(x, a, meta, shrunk_ref)
    lora_shrink_cpu(x, a, meta, shrunk_cpu)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    # only the columns below each row's real rank are specified
    for row, tok in enumerate(meta.token_perm.tolist()):
        if slots[tok] >= 0:
            r = ranks[slots[tok]]
            torch.testing.assert_close(shrunk_cpu[:, row, :r], shrunk_ref[:, row, :r], **tol)
    y_ref, y_cpu = y.clone(), y.clone()
    lora_expand_ref(shrunk_ref, b, scaling, offsets, meta, y_ref)
    lora_expand_cpu(shrunk_ref, b, scaling, offsets, meta, y_cpu)
    scale = float(y_ref.float().abs().max())
    torch.testing.assert_close(y_cpu.float() / scale, y_ref.float() / scale, **tol)
    base_rows = [t for t, s in enumerate(slots) if s < 0]
    assert torch.equal(y_cpu[base_rows], y[base_rows])  # base-only tokens are never touched


def test_plan_uses_views_runs_gathers_and_unpadded_long_segments():
    from loraplex.kernels.lora_cpu import LONG_SEGMENT, _plan

    ranks = [8] * 12

    def plan_for(slots):
        return _plan(build_batch_meta(slots, torch.tensor(ranks, dtype=torch.int32), ranks))

    [spaced] = plan_for([0, 2, 4, 2])
    assert spaced.slots == slice(0, 5, 2) and spaced.rows.shape == (3, 2) and spaced.valid is not None
    runs = plan_for([0, 1, 2, 5, 6])
    assert [b.slots for b in runs] == [slice(0, 3, 1), slice(5, 7, 1)]
    [gathered] = plan_for([0, 2, 3, 5, 7, 9, 11])
    assert isinstance(gathered.slots, torch.Tensor) and gathered.slots.tolist() == [0, 2, 3, 5, 7, 9, 11]
    long_and_short = plan_for([3] * LONG_SEGMENT + [1, 1])
    assert [(b.slots, tuple(b.rows.shape)) for b in long_and_short] == [(slice(3, 4), (1, LONG_SEGMENT)), (slice(1, 2), (1, 2))]
