"""Paged attention and KV write Triton kernels (interpreter, CPU) against attention_ref."""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.helpers import rel_err

from loraplex.kernels.attention_ref import paged_attention_ref, write_kv_cache_ref  # noqa: E402
from loraplex.kernels.triton_attention import (  # noqa: E402
    choose_num_kv_splits,
    paged_attention_triton,
    write_kv_cache_triton,
)

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


def _build_batch(
    seqs: list[tuple[int, int]],  # (cached prefix length, query tokens this step) per sequence
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
):
    """A batch whose K/V (prefix and this step's tokens) are already in a NaN-poisoned cache
    through shuffled (non-contiguous) block tables, and its query as a strided view of a packed
    qkv tensor, as the model produces it."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [ctx + q for ctx, q in seqs]
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns (stay NaN)
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq) + 1
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    for i, n_blocks in enumerate(blocks_per_seq):
        block_tables[i, :n_blocks] = torch.tensor([physical.pop() for _ in range(n_blocks)])
        slots = torch.tensor(
            [int(block_tables[i, p // block_size]) * block_size + p % block_size for p in range(seq_lens[i])]
        )
        k = torch.randn(seq_lens[i], num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_lens[i], num_kv_heads, head_dim, generator=gen).to(dtype)
        write_kv_cache_ref(k, v, kv_cache, slots)
    num_tokens = sum(q for _, q in seqs)
    q_width = num_heads * head_dim
    qkv = torch.randn(num_tokens, q_width + 2 * num_kv_heads * head_dim, generator=gen).to(dtype)
    query = qkv[:, :q_width].view(num_tokens, num_heads, head_dim)  # strided view, as in the model
    query_start_loc = torch.tensor([0] + [q for _, q in seqs], dtype=torch.int32).cumsum(0).to(torch.int32)
    return dict(
        query=query,
        kv_cache=kv_cache,
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=query_start_loc,
        scale=head_dim**-0.5,
        max_query_len=max(q for _, q in seqs),
        max_seq_len=max(seq_lens),
    )


ATTENTION_CASES = {
    # (prefix, query) per sequence: fresh prefill, decode, prefill over a cached prefix, a chunk
    # longer than a query tile, and a context spanning many blocks
    "mixed_gqa2_bs16": dict(
        seqs=[(0, 20), (37, 1), (50, 13), (3, 40), (130, 1)], heads=4, kv_heads=2, head_dim=16, block_size=16,
    ),
    "mixed_gqa4_bs32_d32": dict(
        seqs=[(70, 1), (0, 9), (33, 18), (100, 1)], heads=8, kv_heads=2, head_dim=32, block_size=32,
    ),
    # decode-only batch: 16-row tiles of GQA-packed heads, one query token per sequence
    "decode_only_gqa4": dict(
        seqs=[(5, 1), (90, 1), (16, 1), (0, 1), (47, 1), (200, 1)], heads=8, kv_heads=2, head_dim=16, block_size=16,
    ),
    # a head group that is not a power of two (6 heads over 2 KV heads)
    "gqa3_mixed": dict(seqs=[(19, 1), (0, 11), (64, 5)], heads=6, kv_heads=2, head_dim=16, block_size=16),
    # no GQA (MHA) and a head_dim that is not a power of two
    "mha_odd_head_dim": dict(seqs=[(10, 6), (31, 1)], heads=2, kv_heads=2, head_dim=24, block_size=32),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_paged_attention_matches_reference(name, dtype):
    case = ATTENTION_CASES[name]
    seed = sum(map(ord, name)) * 13 + (1 if dtype == torch.float16 else 0)
    batch = _build_batch(
        case["seqs"], case["heads"], case["kv_heads"], case["head_dim"], case["block_size"], dtype, seed
    )
    out = torch.full(batch["query"].shape, float("nan"), dtype=dtype)
    got = paged_attention_triton(**batch, out=out)
    assert got is out
    ref = paged_attention_ref(**batch)
    assert not out.isnan().any(), "attention left output rows unwritten (or read poisoned cache slots)"
    assert rel_err(out, ref) < TOL[dtype]


SPLIT_CASES = {
    # decode batches over long contexts, split into key ranges: contexts of several splits,
    # one shorter than a single key tile (its later splits are empty), GQA 4 and 1
    "decode_split3_gqa4_bs16": dict(
        seqs=[(700, 1), (12, 1), (301, 1)], heads=8, kv_heads=2, head_dim=16, block_size=16, splits=3,
    ),
    "decode_split7_mha_bs32": dict(
        seqs=[(450, 1), (63, 1)], heads=2, kv_heads=2, head_dim=32, block_size=32, splits=7,
    ),
    # the kernel splits prompt chunks correctly too (the host only splits decode batches)
    "mixed_split2_gqa2_bs16": dict(
        seqs=[(130, 9), (0, 20), (260, 1)], heads=4, kv_heads=2, head_dim=16, block_size=16, splits=2,
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_split_kv_matches_reference(name, dtype):
    case = SPLIT_CASES[name]
    seed = sum(map(ord, name)) * 17 + (1 if dtype == torch.float16 else 0)
    batch = _build_batch(
        case["seqs"], case["heads"], case["kv_heads"], case["head_dim"], case["block_size"], dtype, seed
    )
    out = torch.full(batch["query"].shape, float("nan"), dtype=dtype)
    paged_attention_triton(**batch, out=out, num_kv_splits=case["splits"])
    ref = paged_attention_ref(**batch)
    assert not out.isnan().any(), "a merged row was left unwritten or took a poisoned partial"
    assert rel_err(out, ref) < TOL[dtype]


def test_split_kv_leaves_padding_rows_alone():
    """A graph runner pads the batch with rows no sequence owns; the merge must not touch them."""
    batch = _build_batch([(600, 1), (280, 1)], 4, 1, 16, 16, torch.float32, seed=23)
    pad = torch.randn(2, 4, 16)
    query = torch.cat([batch.pop("query"), pad])  # two padding rows after the real ones
    out = torch.full(query.shape, 7.0)
    paged_attention_triton(query, **batch, out=out, num_kv_splits=4)
    assert torch.equal(out[2:], torch.full_like(out[2:], 7.0))
    assert rel_err(out[:2], paged_attention_ref(query[:2], **batch)) < TOL[torch.float32]


def test_split_kv_choice():
    # one long decode on 8 KV heads splits until about two programs per SM
    assert choose_num_kv_splits(1, 8, 1, 32768, 132) == 32
    assert choose_num_kv_splits(4, 8, 1, 32768, 132) == 9
    # never a split under 256 keys, never a batch that already fills the GPU, never a prefill
    assert choose_num_kv_splits(1, 8, 1, 700, 132) == 2
    assert choose_num_kv_splits(1, 8, 1, 255, 132) == 1
    assert choose_num_kv_splits(64, 8, 1, 32768, 132) == 1
    assert choose_num_kv_splits(1, 8, 16, 32768, 132) == 1


def test_split_kv_chosen_automatically_for_a_small_long_decode_batch():
    batch = _build_batch([(1100, 1)], 2, 1, 16, 16, torch.float32, seed=31)
    assert choose_num_kv_splits(1, 1, 1, batch["max_seq_len"], 132) == 4
    out = torch.full(batch["query"].shape, float("nan"))
    paged_attention_triton(**batch, out=out)
    assert rel_err(out, paged_attention_ref(**batch)) < TOL[torch.float32]


def test_paged_attention_allocates_output_when_not_given():
    batch = _build_batch([(4, 3), (9, 1)], 4, 1, 16, 16, torch.float32, seed=99)
    got = paged_attention_triton(**batch)
    assert rel_err(got, paged_attention_ref(**batch)) < TOL[torch.float32]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_cache_matches_reference(block_size, dtype):
    gen = torch.Generator().manual_seed(block_size * 3 + (1 if dtype == torch.float16 else 0))
    num_tokens, kv_heads, head_dim, num_blocks = 11, 2, 24, 5
    # K and V as strided views of a packed qkv tensor; padding tokens have slot -1
    qkv = torch.randn(num_tokens, 3 * kv_heads * head_dim, generator=gen).to(dtype)
    key = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(num_tokens, kv_heads, head_dim)
    value = qkv[:, 2 * kv_heads * head_dim :].view(num_tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    cache_ref = cache.clone()
    write_kv_cache_triton(key, value, cache, slots)
    write_kv_cache_ref(key, value, cache_ref, slots)
    assert torch.equal(cache.isnan(), cache_ref.isnan()), "wrote outside (or missed) the mapped slots"
    assert torch.equal(torch.nan_to_num(cache), torch.nan_to_num(cache_ref))


def test_write_then_attend_decode_step():
    """A decode step end to end: write the new token's K/V, then attend over prefix + itself."""
    prefix = 21
    batch = _build_batch([(prefix, 0)], 4, 2, 16, 16, torch.float32, seed=5)
    kv_cache, table = batch["kv_cache"], batch["block_tables"]
    gen = torch.Generator().manual_seed(6)
    # the new token lands at position `prefix`, in a block the table already owns or a free one
    assert table[0, prefix // 16] >= 0
    slot = torch.tensor([int(table[0, prefix // 16]) * 16 + prefix % 16])
    k, v = torch.randn(1, 2, 16, generator=gen), torch.randn(1, 2, 16, generator=gen)
    ref_cache = kv_cache.clone()
    write_kv_cache_triton(k, v, kv_cache, slot)
    write_kv_cache_ref(k, v, ref_cache, slot)
    query = torch.randn(1, 4, 16, generator=gen)
    args = dict(
        block_tables=table,
        seq_lens=torch.tensor([prefix + 1], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        scale=0.25,
        max_query_len=1,
        max_seq_len=prefix + 1,
    )
    got = paged_attention_triton(query, kv_cache, **args)
    ref = paged_attention_ref(query, ref_cache, **args)
    assert rel_err(got, ref) < TOL[torch.float32]
