"""The fused CPU LoRA path (what dispatch.lora_apply runs on CPU) against the torch reference
``lora_ref``: mixed real ranks, padding, base tokens, empty slots, 1-3 slices, fp32 and bf16,
in arbitrary token order and in the runner's (rank, slot) order."""

from __future__ import annotations

import random

import pytest
import torch

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


def _reference_apply(x, a, b, scaling, offsets, meta):
    shrunk = torch.zeros(a.shape[0], x.shape[0], a.shape[2])
    lora_shrink_ref(x, a, meta, shrunk)
    y = torch.zeros(x.shape[0], offsets[-1], dtype=x.dtype)
    lora_expand_ref(shrunk, b, scaling, offsets, meta, y)
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_slices", [1, 2, 3])
@pytest.mark.parametrize("num_tokens", [1, 7, 40, 300])  # 300: long segments, batched by length
def test_fused_apply_matches_reference_in_any_token_order(dtype, num_slices, num_tokens):
    """Tokens in arbitrary order (mixed real ranks, padding, base tokens, empty slots): batches
    are gathered and scattered."""
    from loraplex.kernels.lora_cpu import lora_apply_cpu

    meta, x, a, b, scaling, offsets, y, slots, ranks = _case(num_tokens * 7 + num_slices, dtype, num_slices, num_tokens)
    want = y.float() + _reference_apply(x.float(), a.float(), b.float(), scaling, offsets, meta)
    got = y.clone()
    lora_apply_cpu(x, a, b, scaling, offsets, meta, got)
    scale = float(want.abs().max())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float() / scale, want / scale, **tol)
    base_rows = [t for t, s in enumerate(slots) if s < 0]
    assert torch.equal(got[base_rows], y[base_rows])  # base-only tokens are never touched


@pytest.mark.parametrize("seg_len", [1, 2, 20])
def test_fused_apply_on_batch_ordered_by_rank_and_slot_reads_views(seg_len):
    """The runner's order (base first, then by (rank, slot)): each rank's batch is one token
    run, so x and y are used through views; the result is still the reference's."""
    from loraplex.kernels.lora_cpu import _plan, lora_apply_cpu

    gen = torch.Generator().manual_seed(seg_len)
    max_loras, r_max, in_f, offsets = 8, 16, 24, (0, 12, 18, 24)
    ranks = [8, 16, 8, 16, 8, 16, 3, 0]
    used = sorted([0, 1, 2, 3, 4, 5, 6], key=lambda s: (ranks[s], s))
    slots = [-1] * 3 + [s for s in used for _ in range(seg_len)]
    meta = build_batch_meta(slots, torch.tensor(ranks, dtype=torch.int32), ranks)
    x = torch.randn(len(slots), in_f, generator=gen)
    a = torch.randn(3, max_loras, r_max, in_f, generator=gen)
    b = torch.randn(max_loras, offsets[-1], r_max, generator=gen)
    scaling = torch.rand(3, max_loras, generator=gen) * 2
    y = torch.randn(len(slots), offsets[-1], generator=gen)
    plan = _plan(meta)
    assert all(bt.token_start is not None for bt in plan)
    if seg_len < 16:  # short segments of one rank: one batch whose slots are a view
        assert sorted(bt.rank for bt in plan) == [3, 8, 16] and all(isinstance(bt.slots, slice) for bt in plan)
    want = y + _reference_apply(x, a, b, scaling, offsets, meta)
    got = y.clone()
    lora_apply_cpu(x, a, b, scaling, offsets, meta, got)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:3], y[:3])  # base-only tokens untouched


def test_long_segments_batch_by_length_without_much_padding():
    from loraplex.kernels.lora_cpu import MAX_PADDING_FACTOR, _length_groups

    segs, lo = [], 0
    for slot, n in enumerate([40, 44, 41, 300, 42, 17, 18]):
        segs.append((slot, lo, lo + n))
        lo += n
    groups = _length_groups(segs)
    assert sorted(s for g in groups for s in g) == sorted(segs)
    assert [segs[3]] in groups  # the 300-token one alone
    assert any(len(g) >= 4 for g in groups)  # the ~40-token ones together
    for g in groups:
        lens = [hi - lo for _, lo, hi in g]
        assert len(g) * max(lens) <= MAX_PADDING_FACTOR * sum(lens)
