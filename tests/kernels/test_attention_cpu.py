"""The batched CPU paged attention equals the torch reference (the oracle)."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.attention_cpu import paged_attention_cpu
from loraplex.kernels.attention_ref import paged_attention_ref


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (9, 3)])
def test_matches_reference_on_mixed_batch(dtype, tol, num_heads, num_kv_heads):
    torch.manual_seed(0)
    block_size, head_dim, num_blocks = 16, 32, 40
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    # (cached prefix, query length): decodes, a first prefill, a chunk over a prefix, a 1-token prompt
    shapes = [(17, 1), (0, 23), (40, 9), (5, 1), (0, 1), (63, 1), (31, 33)]
    seq_lens = [p + q for p, q in shapes]
    max_blocks = max((n + block_size - 1) // block_size for n in seq_lens)
    perm = torch.randperm(num_blocks).tolist()
    tables = [[perm.pop() for _ in range(max_blocks)] for _ in shapes]
    query_start = [0]
    for _, q in shapes:
        query_start.append(query_start[-1] + q)
    query = torch.randn(query_start[-1], num_heads, head_dim).to(dtype)
    args = (
        query,
        kv_cache,
        torch.tensor(tables, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor(query_start, dtype=torch.int32),
        head_dim**-0.5,
        max(q for _, q in shapes),
        max(seq_lens),
    )
    got, want = paged_attention_cpu(*args), paged_attention_ref(*args)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("block_size", [16, 32])
def test_many_prompt_chunks_grouped_and_one_long(block_size):
    """Short prompts (some over a cached prefix) share padded calls; a long one goes alone."""
    from loraplex.kernels.attention_cpu import _prefill_groups

    gen = torch.Generator().manual_seed(block_size)
    num_heads, num_kv_heads, head_dim, num_blocks = 6, 2, 16, 120
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    shapes = [(0, 30 + i % 7) for i in range(10)] + [(13, 5), (20, 17), (3, 1), (0, 300), (50, 1)]
    seq_lens = [p + q for p, q in shapes]
    max_blocks = max((n + block_size - 1) // block_size for n in seq_lens)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[perm.pop() if b * block_size < n else 0 for b in range(max_blocks)] for n in seq_lens]
    query_start = [0]
    for _, q in shapes:
        query_start.append(query_start[-1] + q)
    query = torch.randn(query_start[-1], num_heads, head_dim, generator=gen)
    args = (query, kv_cache, torch.tensor(tables, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
            torch.tensor(query_start, dtype=torch.int32), head_dim**-0.5, max(q for _, q in shapes), max(seq_lens))
    chunks = [(i, q, p + q) for i, (p, q) in enumerate(shapes) if q > 1]
    groups = _prefill_groups(chunks)
    assert sorted(c for g in groups for c in g) == sorted(chunks)
    assert any(len(g) > 1 for g in groups), "short prompts should share a call"
    assert [(13, 300, 300)] in groups, "the long prompt should run alone"
    got, want = paged_attention_cpu(*args), paged_attention_ref(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_write_kv_cache_matches_reference_and_skips_padding():
    from loraplex.kernels.attention_cpu import write_kv_cache_cpu
    from loraplex.kernels.attention_ref import write_kv_cache_ref

    gen = torch.Generator().manual_seed(7)
    cache = torch.randn(2, 6, 16, 2, 8, generator=gen)
    key, value = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
    slots = torch.tensor([3, 40, -1, 95, 17])
    got, want = cache.clone(), cache.clone()
    write_kv_cache_cpu(key, value, got, slots)
    write_kv_cache_ref(key, value, want, slots)
    assert torch.equal(got, want) and not torch.equal(got, cache)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
def test_pure_decode_batch_with_strided_query(num_heads, num_kv_heads):
    """A step of decodes only (the common case) takes the grouped-heads path; the query is a
    view into a packed qkv projection, as the model passes it."""
    gen = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    block_size, head_dim, num_blocks = 16, 32, 64
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    seq_lens = [1, 16, 17, 40, 95, 33]
    max_blocks = max((n + block_size - 1) // block_size for n in seq_lens)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(max_blocks)] for _ in seq_lens]
    qkv = torch.randn(len(seq_lens), (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    query = qkv[:, : num_heads * head_dim].view(len(seq_lens), num_heads, head_dim)
    assert not query.is_contiguous()
    args = (query, kv_cache, torch.tensor(tables, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
            torch.arange(len(seq_lens) + 1, dtype=torch.int32), head_dim**-0.5, 1, max(seq_lens))
    got, want = paged_attention_cpu(*args), paged_attention_ref(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
