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
