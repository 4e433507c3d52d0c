"""Calibrated KV-cache scales (``k_scale`` / ``v_scale`` != 1) on every attention path: the CPU
twin, the reference and the Triton kernels (interpreter; float32 and float16 queries; split-KV;
a window with soft-capping), against dense causal attention in float64 over K/V written as
vLLM's cache write does (``x / scale`` in fp32, clamped to the format's finite range, torch's
fp8 cast) and read back times the scale. K/V are large (hundreds to thousands) so that the
scale matters: a cache written with 1.0 saturates, and reading a calibrated cache with 1.0
gives another result (both checked, so the tests can fail)."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.kv_quant import dequantize_kv, quantize_kv
from tests.kernels.test_fp8_kv_cache import (
    CASES, FP8, FP8_MAX, PATH_COMPUTE, PATHS, TOL, build, dense_attention, rel_err,
)

# |K|, |V| reach several times e4m3's range (scales > 1); e5m2's range is wider than float16's, so
# there a calibrated scale is < 1 (finer steps for values far below the range)
SPREAD = {torch.float8_e4m3fn: 700.0, torch.float8_e5m2: 3000.0}


def stored(x: torch.Tensor, fp8: torch.dtype, scale: float) -> torch.Tensor:
    """``x`` as the cache holds it: ``x / scale`` in fp32, clamped, torch's fp8 cast (vLLM's write)."""
    limit = FP8_MAX[fp8]
    return (x.float() / scale).clamp(-limit, limit).to(fp8)


def read_back(x: torch.Tensor, fp8: torch.dtype, scale: float) -> torch.Tensor:
    """What a read of the cache must see: the stored value times the scale, in float64."""
    return stored(x, fp8, scale).double() * scale


def calibrated(keys, values, fp8) -> tuple[float, float]:
    """amax / format maximum over all K and over all V: what a calibration would store."""
    limit = FP8_MAX[fp8]
    return (max(k.abs().max().item() for k in keys) / limit, max(v.abs().max().item() for v in values) / limit)


def expected(keys, values, query, meta, fp8, k_scale, v_scale, **options) -> torch.Tensor:
    out, starts = [], meta["query_start_loc"].tolist()
    for i, (k, v) in enumerate(zip(keys, values)):
        q = query[starts[i]: starts[i + 1]]
        out.append(dense_attention_options(q, read_back(k, fp8, k_scale), read_back(v, fp8, v_scale), meta["scale"],
                                           **options))
    return torch.cat(out)


def dense_attention_options(q, k, v, scale, sliding_window=None, softcap=None) -> torch.Tensor:
    """``dense_attention`` with Gemma 2's soft-cap and a sliding window (float64)."""
    if sliding_window is None and softcap is None:
        return dense_attention(q, k, v, scale)
    q_len, heads = q.shape[0], q.shape[1]
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(k.shape[0] - q_len, k.shape[0]).unsqueeze(1)
    k_pos = torch.arange(k.shape[0]).unsqueeze(0)
    hidden = k_pos > q_pos
    if sliding_window is not None:
        hidden |= k_pos <= q_pos - sliding_window
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(hidden, float("-inf")), -1), v)


def test_quantize_and_dequantize_follow_the_reference():
    """``kv_quant``'s write and read against the formulas above, element by element."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, 16, generator=gen) * 2000
    for fp8 in FP8:
        for scale in (0.37, 4.5, 300.0):
            q = quantize_kv(x, fp8, scale)
            assert q.dtype == fp8
            assert torch.equal(q.float(), stored(x, fp8, scale).float())
            assert torch.allclose(dequantize_kv(q, scale).double(), read_back(x, fp8, scale), rtol=1e-7)  # fp32 product
        assert torch.equal(quantize_kv(x, fp8).float(), stored(x, fp8, 1.0).float())  # 1.0: today's write
    # a model-dtype cache round-trips through the scale too (the kernels treat every cache alike)
    assert torch.allclose(dequantize_kv(quantize_kv(x, torch.float32, 3.0), 3.0), x, rtol=1e-6)


@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("path", list(PATHS))
def test_write_stores_x_over_scale(path, fp8):
    """Each write path stores ``stored(x / scale)`` at the mapped slots (padding -1 skipped, the
    NaN-poisoned rest untouched), K and V with their own scale, K and V as strided views."""
    gen = torch.Generator().manual_seed(4)
    tokens, kvh, d, bs, blocks = 9, 2, 16, 16, 4
    qkv = torch.randn(tokens, 3 * kvh * d, generator=gen) * SPREAD[fp8]
    key = qkv[:, kvh * d: 2 * kvh * d].view(tokens, kvh, d)
    value = qkv[:, 2 * kvh * d:].view(tokens, kvh, d)
    k_scale, v_scale = calibrated([key], [value], fp8)
    v_scale *= 0.5  # some V still saturate: the clamp is on x / scale
    slots = torch.randperm(blocks * bs, generator=gen)[:tokens]
    slots[4] = -1
    cache = torch.full((2, blocks, bs, kvh, d), float("nan")).to(fp8)
    PATHS[path][0](key, value, cache, slots, k_scale, v_scale)
    rows = cache.view(2, -1, kvh, d)
    live = slots >= 0
    assert torch.equal(rows[0, slots[live]].float(), stored(key[live], fp8, k_scale).float())
    assert torch.equal(rows[1, slots[live]].float(), stored(value[live], fp8, v_scale).float())
    others = torch.ones(blocks * bs, dtype=torch.bool)
    others[slots[live]] = False
    assert rows[:, others].float().isnan().all()
    assert min(k_scale, v_scale) > 2 or max(k_scale, v_scale) < 0.5  # far from 1.0


OPTIONS = {
    "plain": {},
    "split3": {"num_kv_splits": 3},  # Triton only: keys split across programs, partials merged
    "window_softcap": {"sliding_window": 11, "softcap": 5.0},
}


PATH_IDS = ["cpu", "ref", "triton-fp32", "triton-fp16"]
# split-KV is the Triton kernel's alone
PATH_OPTIONS = [pytest.param(path, compute, option, id=f"{path_id}-{option}")
                for (path, compute), path_id in zip(PATH_COMPUTE, PATH_IDS) for option in OPTIONS
                if path == "triton" or "num_kv_splits" not in OPTIONS[option]]


@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("path,compute,option", PATH_OPTIONS)
@pytest.mark.parametrize("name", list(CASES))
def test_attention_reads_stored_times_scale(name, option, path, compute, fp8):
    options = dict(OPTIONS[option])
    write, attend = PATHS[path]
    poison = 7.0 if path == "cpu" else float("nan")  # the CPU twin multiplies masked slots by zero weights
    keys, values, slots, query, cache, meta = build(CASES[name], compute, fp8, seed=sum(map(ord, name)) + 1,
                                                    spread=SPREAD[fp8], poison=poison)
    query = (query.float() / SPREAD[fp8] * 4).to(compute)  # scores of order 1 over the large K
    k_scale, v_scale = calibrated(keys, values, fp8)
    assert min(k_scale, v_scale) > 2 or max(k_scale, v_scale) < 0.5  # far from 1.0
    for k, v, s in zip(keys, values, slots):
        write(k, v, cache, s, k_scale, v_scale)
    out = attend(query, cache, **meta, **options, k_scale=k_scale, v_scale=v_scale)
    attention_options = {k: v for k, v in options.items() if k != "num_kv_splits"}
    ref = expected(keys, values, query, meta, fp8, k_scale, v_scale, **attention_options)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[compute]
    # the scales are read: the same bytes read with 1.0 are another attention
    unscaled = attend(query, cache, **meta, **options)
    assert rel_err(unscaled, ref) > 100 * TOL[compute]


@pytest.mark.parametrize("path,compute", PATH_COMPUTE, ids=PATH_IDS)
def test_calibrated_scales_beat_saturation(path, compute):
    """The point of a scale: e4m3 attention over K/V beyond 448 written with calibrated scales is
    close to attention over the exact K/V; written with 1.0 it saturates and is far off."""
    fp8 = torch.float8_e4m3fn
    write, attend = PATHS[path]
    case = CASES["mixed_gqa2_bs16"]
    exact_out, errors = None, {}
    for label in ("calibrated", "one"):
        keys, values, slots, query, cache, meta = build(case, compute, fp8, seed=21, spread=SPREAD[fp8],
                                                        poison=7.0 if path == "cpu" else float("nan"))
        query = (query.float() / SPREAD[fp8] * 4).to(compute)
        k_scale, v_scale = calibrated(keys, values, fp8) if label == "calibrated" else (1.0, 1.0)
        for k, v, s in zip(keys, values, slots):
            write(k, v, cache, s, k_scale, v_scale)
        out = attend(query, cache, **meta, k_scale=k_scale, v_scale=v_scale)
        starts = meta["query_start_loc"].tolist()
        exact_out = torch.cat([dense_attention(query[starts[i]: starts[i + 1]], k.double(), v.double(), meta["scale"])
                               for i, (k, v) in enumerate(zip(keys, values))])
        errors[label] = rel_err(out, exact_out)
    assert errors["calibrated"] < 0.1  # e4m3's 3 mantissa bits
    assert errors["one"] > 3 * errors["calibrated"], errors
