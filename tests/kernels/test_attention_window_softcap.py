"""Sliding-window attention and logit soft-capping (Gemma 2 / 3, Mistral) in all three attention
paths: the torch reference against transformers' own Gemma 2 eager attention, then the CPU path
and the Triton kernels (interpreter, float16 and float32) against the reference."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.attention_cpu import paged_attention_cpu, plan_paged_attention
from loraplex.kernels.attention_ref import gather_kv, paged_attention_ref
from loraplex.kernels.triton_attention import paged_attention_triton
from tests.kernels.helpers import rel_err
from tests.kernels.test_triton_attention import TOL, _build_batch

CASES = {
    # (prefix, query) per sequence. A window shorter than a block, with prefill chunks over a
    # prefix and decodes; a window spanning blocks; the same with 32-token blocks; decodes only
    "window5_bs16_mixed": dict(seqs=[(0, 20), (37, 1), (50, 13), (130, 1)], block_size=16, window=5, softcap=None),
    "window40_bs16_softcap": dict(seqs=[(3, 40), (70, 1), (0, 9), (90, 7)], block_size=16, window=40, softcap=2.0),
    "window70_bs32_softcap": dict(seqs=[(100, 1), (33, 18), (0, 75)], block_size=32, window=70, softcap=3.0),
    "window20_bs32_decode": dict(seqs=[(5, 1), (90, 1), (47, 1), (200, 1)], block_size=32, window=20, softcap=None),
    "softcap_only_bs16": dict(seqs=[(19, 1), (0, 11), (64, 5)], block_size=16, window=None, softcap=1.5),
    # edges: each token sees only itself; a window of exactly one block
    "window1_bs16": dict(seqs=[(0, 7), (20, 1), (33, 4)], block_size=16, window=1, softcap=None),
    "window16_bs16_softcap": dict(seqs=[(0, 40), (47, 1), (15, 3)], block_size=16, window=16, softcap=2.0),
}


def _batch(name: str, dtype: torch.dtype, poisoned: bool = True) -> dict:
    """The Triton tests' batch (cache slots nobody wrote are NaN); ``poisoned=False`` fills those
    slots with random values instead: the CPU path's SDPA reads whole blocks, masked, and an
    engine's cache holds stale finite values there, never NaN."""
    case = CASES[name]
    seed = sum(map(ord, name)) * 7 + (1 if dtype == torch.float16 else 0)
    batch = _build_batch(case["seqs"], 4, 2, 16, case["block_size"], dtype, seed)
    batch["scale"] = 0.5  # large enough that the soft-caps (1.5 to 3) bite
    if not poisoned:
        cache = batch["kv_cache"]
        stale = torch.randn(cache.shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
        batch["kv_cache"] = torch.where(cache.isnan(), stale, cache)
    return batch


def test_reference_matches_transformers_gemma2_eager_attention():
    """One sequence's chunk over its prefix, per transformers: Gemma 2's eager attention with
    the sliding-window mask of transformers' masking_utils (kv > q - window, kv <= q)."""
    from transformers.masking_utils import causal_mask_function, sliding_window_overlay, and_masks
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    batch = _build_batch([(45, 12)], 4, 2, 16, 16, torch.float32, seed=3)
    window, softcap, scale = 9, 2.0, 0.5
    ours = paged_attention_ref(**{**batch, "scale": scale}, sliding_window=window, softcap=softcap)
    k, v = gather_kv(batch["kv_cache"], batch["block_tables"][0], 57)  # [57, kvh, d]
    allowed = and_masks(causal_mask_function, sliding_window_overlay(window))
    mask = allowed(0, 0, torch.arange(45, 57)[:, None], torch.arange(57)[None, :])  # [12, 57]
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))[None, None]  # [1, 1, 12, 57]
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 2, False
    want, _ = eager_attention_forward(
        module, batch["query"].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        additive, scaling=scale, softcap=softcap,
    )  # [1, 12, H, d]
    torch.testing.assert_close(ours, want[0], rtol=1e-5, atol=1e-5)
    # the window and the cap both change the answer here (so neither check above is vacuous)
    assert rel_err(paged_attention_ref(**{**batch, "scale": scale}, softcap=softcap), ours) > 1e-2
    assert rel_err(paged_attention_ref(**{**batch, "scale": scale}, sliding_window=window), ours) > 1e-2


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_path_matches_reference(name, dtype, tol):
    batch = _batch(name, torch.float32, poisoned=False)
    batch["query"], batch["kv_cache"] = batch["query"].to(dtype), batch["kv_cache"].to(dtype)
    case = CASES[name]
    got = paged_attention_cpu(**batch, sliding_window=case["window"], softcap=case["softcap"])
    want = paged_attention_ref(**batch, sliding_window=case["window"], softcap=case["softcap"])
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_cpu_plan_serves_layers_of_different_windows():
    """One plan per step, reused by full and windowed layers in any order (Gemma's alternation)."""
    batch = _batch("window40_bs16_softcap", torch.float32, poisoned=False)
    plan = plan_paged_attention(batch["block_tables"], batch["seq_lens"], batch["query_start_loc"], 16)
    for window in (None, 40, 7, None, 40):
        got = paged_attention_cpu(**batch, plan=plan, sliding_window=window)
        torch.testing.assert_close(got, paged_attention_ref(**batch, sliding_window=window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_reference(name, dtype):
    batch = _batch(name, dtype)
    case = CASES[name]
    out = torch.full(batch["query"].shape, float("nan"), dtype=dtype)
    paged_attention_triton(**batch, out=out, sliding_window=case["window"], softcap=case["softcap"])
    want = paged_attention_ref(**batch, sliding_window=case["window"], softcap=case["softcap"])
    assert not out.isnan().any(), "rows left unwritten, or poisoned cache slots read"
    assert rel_err(out, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_split_kv_with_window_and_softcap(dtype):
    """Split-KV decode divides only the window's keys among the splits (some splits empty)."""
    batch = _build_batch([(500, 1), (30, 1), (260, 1)], 4, 2, 16, 16, dtype, seed=41 + (dtype == torch.float16))
    batch["scale"] = 0.5
    out = torch.full(batch["query"].shape, float("nan"), dtype=dtype)
    paged_attention_triton(**batch, out=out, num_kv_splits=3, sliding_window=100, softcap=2.5)
    want = paged_attention_ref(**batch, sliding_window=100, softcap=2.5)
    assert not out.isnan().any()
    assert rel_err(out, want) < TOL[dtype]


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_cpu_decode_reads_only_the_windows_blocks(softcap):
    """Decodes over long contexts: a windowed layer gathers the blocks its window reaches (2 of
    16-token blocks for a 20-position window here, not 32), and still answers as the reference."""
    batch = _build_batch([(500, 1), (30, 1), (261, 1), (16, 1)], 4, 2, 16, 16, torch.float32, seed=77)
    stale = torch.randn(batch["kv_cache"].shape, generator=torch.Generator().manual_seed(78))
    batch["kv_cache"] = torch.where(batch["kv_cache"].isnan(), stale, batch["kv_cache"])
    plan = plan_paged_attention(batch["block_tables"], batch["seq_lens"], batch["query_start_loc"], 16)
    got = paged_attention_cpu(**batch, plan=plan, sliding_window=20, softcap=softcap)
    assert plan.decode.num_blocks == 32 and plan.decode_for(20).num_blocks == 2
    want = paged_attention_ref(**batch, sliding_window=20, softcap=softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
