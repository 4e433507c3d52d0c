"""Block-table entries before a sliding window are never read: the block manager gives those
blocks back (``FREED_BLOCK``), so every attention path must skip them, not read and mask them.
Here the freed entries point at a block filled with NaN (a read, even masked, turns the row NaN),
and each path must answer as the reference over the intact block table."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.attention_cpu import paged_attention_cpu
from loraplex.kernels.attention_ref import paged_attention_ref
from loraplex.kernels.triton_attention import paged_attention_triton
from tests.kernels.helpers import rel_err
from tests.kernels.test_triton_attention import TOL, _build_batch

CASES = {
    # (prefix, query) per sequence: decodes far past the window, chunks whose first query's window
    # starts mid-block, a chunk crossing the window's length, a short one with nothing freed
    "window24_bs16": dict(seqs=[(200, 1), (70, 30), (37, 1), (5, 40), (100, 7)], block_size=16, window=24),
    "window5_bs16": dict(seqs=[(64, 1), (33, 20), (130, 3), (0, 9)], block_size=16, window=5),
    "window32_bs16": dict(seqs=[(47, 1), (48, 1), (49, 17), (300, 64)], block_size=16, window=32),
    "window1_bs8": dict(seqs=[(40, 1), (17, 6), (9, 1)], block_size=8, window=1),
    "window20_bs8_softcap": dict(seqs=[(90, 1), (61, 25), (21, 2)], block_size=8, window=20, softcap=2.0),
}


def freed_entries(ctx: int, window: int, block_size: int) -> int:
    """Leading blocks wholly before the first query's window (keys from ctx - window + 1)."""
    return max(0, ctx - window + 1) // block_size


def _with_freed_blocks(batch: dict, seqs, window: int, block_size: int) -> tuple[dict, int]:
    """``batch`` with one more cache block, all NaN, that every freed table entry points at."""
    cache = batch["kv_cache"]
    nan_block = torch.full_like(cache[:, :1], float("nan"))
    freed = dict(batch, kv_cache=torch.cat([cache, nan_block], dim=1), block_tables=batch["block_tables"].clone())
    sentinel = cache.shape[1]
    num_freed = 0
    for i, (ctx, _) in enumerate(seqs):
        n = freed_entries(ctx, window, block_size)
        freed["block_tables"][i, :n] = sentinel
        num_freed += n
    return freed, num_freed


def _case(name: str, dtype: torch.dtype, stale_finite: bool) -> tuple[dict, dict, dict]:
    case = CASES[name]
    seed = sum(map(ord, name)) + (1 if dtype == torch.float16 else 0)
    batch = _build_batch(case["seqs"], 4, 2, 16, case["block_size"], dtype, seed)
    batch["scale"] = 0.5
    if stale_finite:  # slots nobody wrote finite (the reference's own case); else NaN
        stale = torch.randn(batch["kv_cache"].shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
        batch["kv_cache"] = torch.where(batch["kv_cache"].isnan(), stale, batch["kv_cache"])
    freed, num_freed = _with_freed_blocks(batch, case["seqs"], case["window"], case["block_size"])
    assert num_freed > 0
    return case, batch, freed


def _kwargs(case: dict) -> dict:
    return dict(sliding_window=case["window"], softcap=case.get("softcap"))


@pytest.mark.parametrize("name", list(CASES))
def test_reference_skips_freed_blocks(name):
    case, intact, freed = _case(name, torch.float32, stale_finite=True)
    want = paged_attention_ref(**intact, **_kwargs(case))
    got = paged_attention_ref(**freed, **_kwargs(case))
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # the window is real here: attending to the whole context gives another answer
    assert rel_err(paged_attention_ref(**intact, softcap=case.get("softcap")), want) > 1e-2


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_path_skips_freed_blocks(name, dtype, tol):
    case, intact, freed = _case(name, dtype, stale_finite=False)
    got = paged_attention_cpu(**freed, **_kwargs(case))
    want = paged_attention_ref(**intact, **_kwargs(case))
    assert not got.isnan().any(), "a freed (NaN) block was read"
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_triton_skips_freed_blocks(name, dtype):
    """Triton under the interpreter; slots nobody wrote are NaN too, so any stray read shows."""
    case, intact, freed = _case(name, dtype, stale_finite=False)
    out = torch.full(freed["query"].shape, float("nan"), dtype=dtype)
    paged_attention_triton(**freed, out=out, **_kwargs(case))
    want = paged_attention_ref(**intact, **_kwargs(case))
    assert not out.isnan().any(), "rows left unwritten, or a freed (NaN) block read"
    assert rel_err(out, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_split_kv_decodes_skip_freed_blocks(dtype):
    """Split-KV (decode batches) divides the window's keys among the splits, none before it."""
    seqs = [(500, 1), (61, 1), (260, 1), (30, 1)]
    batch = _build_batch(seqs, 4, 2, 16, 16, dtype, seed=5 + (dtype == torch.float16))
    freed, num_freed = _with_freed_blocks(batch, seqs, 100, 16)
    assert num_freed > 0
    out = torch.full(batch["query"].shape, float("nan"), dtype=dtype)
    paged_attention_triton(**freed, out=out, num_kv_splits=3, sliding_window=100)
    assert not out.isnan().any()
    assert rel_err(out, paged_attention_ref(**batch, sliding_window=100)) < TOL[dtype]
