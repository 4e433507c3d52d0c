"""An fp8 KV cache (``kv_cache_dtype`` fp8_e4m3 / fp8_e5m2) on every attention path: the CPU twin
(``attention_cpu``), the reference (``attention_ref``) and the Triton kernels (interpreter),
against dense causal attention in float64 over K/V rounded through the same fp8 format by torch's
own cast, with saturation at the format's largest finite value (448 / 57344, as vLLM's
conversion saturates)."""

from __future__ import annotations

import math

import pytest
import torch

from loraplex.kernels.attention_cpu import paged_attention_cpu, write_kv_cache_cpu
from loraplex.kernels.attention_ref import paged_attention_ref, write_kv_cache_ref
from loraplex.kernels.triton_attention import paged_attention_triton, write_kv_cache_triton

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FP8 = list(FP8_MAX)
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}
PATHS = {
    "cpu": (write_kv_cache_cpu, paged_attention_cpu),
    "ref": (write_kv_cache_ref, paged_attention_ref),
    "triton": (write_kv_cache_triton, paged_attention_triton),
}

CASES = {
    # (cached prefix, query tokens) per sequence: prefill over a prefix, decode, fresh prefill
    "mixed_gqa2_bs16": dict(seqs=[(37, 1), (50, 13), (0, 20), (3, 1)], heads=4, kv_heads=2, head_dim=16, block_size=16),
    "mixed_gqa4_bs32": dict(seqs=[(70, 1), (33, 18), (0, 9)], heads=8, kv_heads=2, head_dim=32, block_size=32),
    "decode_only_gqa4_bs16": dict(seqs=[(5, 1), (90, 1), (16, 1)], heads=8, kv_heads=2, head_dim=16, block_size=16),
}


def rounded(x: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """``x`` through ``fp8`` and back (torch's cast after clamping to the finite range), in float64."""
    limit = FP8_MAX[fp8]
    return x.float().clamp(-limit, limit).to(fp8).to(torch.float64)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last ``q_len`` positions: q [q_len, H, d], k/v [seq_len, kvh, d] (float64)."""
    q_len, heads = q.shape[0], q.shape[1]
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(k.shape[0] - q_len, k.shape[0]).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)


def build(case: dict, compute: torch.dtype, fp8: torch.dtype, seed: int, spread: float = 1.0, poison=float("nan")):
    """Per sequence its K/V (compute dtype) and slots in shuffled blocks; the query; an fp8 cache
    whose unwritten slots hold ``poison`` (the CPU twin multiplies masked slots by zero weights,
    so it gets a finite poison: an engine's cache holds zeros or old finite K/V there)."""
    gen = torch.Generator().manual_seed(seed)
    bs, kvh, d = case["block_size"], case["kv_heads"], case["head_dim"]
    seq_lens = [ctx + q for ctx, q in case["seqs"]]
    per_seq = [math.ceil(n / bs) for n in seq_lens]
    num_blocks = sum(per_seq) + 3
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(per_seq) + 1, dtype=torch.int32)
    keys, values, slots = [], [], []
    for i, n in enumerate(seq_lens):
        tables[i, : per_seq[i]] = torch.tensor([physical.pop() for _ in range(per_seq[i])])
        slots.append(torch.tensor([int(tables[i, p // bs]) * bs + p % bs for p in range(n)]))
        keys.append((torch.randn(n, kvh, d, generator=gen) * spread).to(compute))
        values.append((torch.randn(n, kvh, d, generator=gen) * spread).to(compute))
    num_tokens = sum(q for _, q in case["seqs"])
    query = torch.randn(num_tokens, case["heads"], d, generator=gen).to(compute)
    cache = torch.full((2, num_blocks, bs, kvh, d), poison).to(fp8)
    meta = dict(
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0] + [q for _, q in case["seqs"]]).cumsum(0).to(torch.int32),
        scale=d**-0.5,
        max_query_len=max(q for _, q in case["seqs"]),
        max_seq_len=max(seq_lens),
    )
    return keys, values, slots, query, cache, meta


def expected(keys, values, query, meta, fp8) -> torch.Tensor:
    out, starts = [], meta["query_start_loc"].tolist()
    for i, (k, v) in enumerate(zip(keys, values)):
        out.append(dense_attention(query[starts[i] : starts[i + 1]], rounded(k, fp8), rounded(v, fp8), meta["scale"]))
    return torch.cat(out)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


# the CPU paths compute in the model's dtype (float32 / bfloat16 on CPU); Triton in float16 too
PATH_COMPUTE = [("cpu", torch.float32), ("ref", torch.float32), ("triton", torch.float32), ("triton", torch.float16)]


@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("path,compute", PATH_COMPUTE, ids=["cpu", "ref", "triton-fp32", "triton-fp16"])
@pytest.mark.parametrize("name", list(CASES))
def test_attention_over_fp8_cache_is_attention_over_fp8_rounded_kv(name, path, compute, fp8):
    write, attend = PATHS[path]
    poison = 7.0 if path == "cpu" else float("nan")
    keys, values, slots, query, cache, meta = build(CASES[name], compute, fp8, seed=sum(map(ord, name)), poison=poison)
    for k, v, s in zip(keys, values, slots):  # written one sequence at a time, as prefill chunks would
        write(k, v, cache, s)
    assert cache.dtype == fp8
    out = attend(query, cache, **meta)
    ref = expected(keys, values, query, meta, fp8)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[compute]
    # the check can fail: attention over the unrounded K/V is measurably different
    exact = torch.cat([dense_attention(query[a:b], k.double(), v.double(), meta["scale"])
                       for k, v, a, b in zip(keys, values, meta["query_start_loc"][:-1].tolist(),
                                             meta["query_start_loc"][1:].tolist())])
    assert rel_err(exact, ref) > 3 * TOL[compute]


@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("path", list(PATHS))
def test_write_stores_torch_rounding_of_each_element(path, fp8):
    """The bytes each write path stores are torch's fp8 cast of the clamped value, at the mapped
    slots only (padding slots -1 skipped, other slots untouched); K and V as strided views."""
    gen = torch.Generator().manual_seed(3)
    tokens, kvh, d, bs, blocks = 9, 2, 16, 16, 4
    qkv = torch.randn(tokens, 3 * kvh * d, generator=gen) * 100
    key = qkv[:, kvh * d : 2 * kvh * d].view(tokens, kvh, d)
    value = qkv[:, 2 * kvh * d :].view(tokens, kvh, d)
    slots = torch.randperm(blocks * bs, generator=gen)[:tokens]
    slots[4] = -1
    cache = torch.full((2, blocks, bs, kvh, d), float("nan")).to(fp8)
    PATHS[path][0](key, value, cache, slots)
    rows = cache.view(2, -1, kvh, d).float()
    live = slots >= 0
    assert torch.equal(rows[0, slots[live]].double(), rounded(key[live], fp8))
    assert torch.equal(rows[1, slots[live]].double(), rounded(value[live], fp8))
    others = torch.ones(blocks * bs, dtype=torch.bool)
    others[slots[live]] = False
    assert rows[:, others].isnan().all()


@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("path", list(PATHS))
def test_values_beyond_the_format_saturate(path, fp8):
    """K/V far beyond fp8's range (and inf) are stored as the largest finite value with their
    sign: no inf or NaN in the cache, and attention over them stays finite."""
    limit = FP8_MAX[fp8]
    case = dict(seqs=[(20, 5), (0, 1)], heads=2, kv_heads=1, head_dim=16, block_size=16)
    keys, values, slots, query, cache, meta = build(case, torch.float32, fp8, seed=11, spread=limit * 40, poison=0.0)
    keys[0][3, 0, 5], values[0][7, 0, 2], values[1][0, 0, 0] = float("inf"), float("-inf"), float("inf")
    for k, v, s in zip(keys, values, slots):
        write, attend = PATHS[path]
        write(k, v, cache, s)
    stored = torch.cat([cache.view(2, -1, 1, 16)[:, s] for s in slots], 1).float()  # [2, tokens, 1, 16]
    assert stored.isfinite().all()
    original = torch.cat([torch.stack([k, v]) for k, v in zip(keys, values)], 1)
    beyond = original.abs() > limit
    assert beyond.float().mean() > 0.5  # most values needed saturating
    assert torch.equal(stored[beyond], torch.sign(original[beyond]) * limit)
    # a tiny query keeps the softmax away from the max-shift limits of fp32; outputs must be finite
    out = attend(query * 1e-6, cache, **meta)
    assert out.isfinite().all()


@pytest.mark.parametrize("capability,fp8,refused", [
    ((8, 0), torch.float8_e4m3fn, True), ((8, 6), torch.float8_e4m3fn, True), ((8, 9), torch.float8_e4m3fn, False),
    ((9, 0), torch.float8_e4m3fn, False), ((8, 0), torch.float8_e5m2, False), ((7, 5), torch.float8_e5m2, False),
])
def test_e4m3_is_refused_where_tritons_cuda_backend_lacks_it(monkeypatch, capability, fp8, refused):
    """Triton's CUDA backend adds fp8e4nv to its fp8 types from sm_89 on; fp8e5 is always there."""
    from loraplex.kernels.kv_quant import check_kv_dtype_device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    if refused:
        with pytest.raises(ValueError, match="compute capability 8.9 or later .* use fp8_e5m2 or auto"):
            check_kv_dtype_device(fp8, torch.device("cuda"))
    else:
        check_kv_dtype_device(fp8, torch.device("cuda"))
    check_kv_dtype_device(fp8, torch.device("cpu"))  # the CPU path reads either format


def test_every_configurable_kv_cache_dtype_has_a_storage_dtype():
    """The names EngineConfig accepts (config.KV_CACHE_DTYPES) are the ones kv_quant maps."""
    from loraplex.config import KV_CACHE_DTYPES
    from loraplex.kernels.kv_quant import FP8_KV_DTYPES, MODEL_DTYPE_KV_DTYPES

    assert set(KV_CACHE_DTYPES) == {"auto", *MODEL_DTYPE_KV_DTYPES, *FP8_KV_DTYPES}
