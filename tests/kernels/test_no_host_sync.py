"""The launch path reads no tensor value on the host: no device->host sync on CUDA, so the
launches can be captured in a CUDA graph. Checked by trapping every Tensor method that turns
device data into host values while the launchers run (the interpreter itself uses none)."""

from __future__ import annotations

import contextlib

import torch

from tests.kernels.helpers import make_meta

from loraplex.kernels.triton_attention import paged_attention_triton, write_kv_cache_triton  # noqa: E402
from loraplex.kernels.triton_lora import lora_expand_triton, lora_shrink_triton  # noqa: E402

HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "nonzero")


@contextlib.contextmanager
def trap_host_reads():
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    calls: list[str] = []

    def trap(name):
        original = saved[name]

        def wrapper(self, *args, **kwargs):
            calls.append(name)
            return original(self, *args, **kwargs)

        return wrapper

    for name in HOST_READS:
        setattr(torch.Tensor, name, trap(name))
    try:
        yield calls
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


def test_trap_sees_a_host_read():
    with trap_host_reads() as calls:
        torch.ones(2).sum().item()
    assert calls == ["item"]


def test_launchers_read_no_tensor_values_on_the_host():
    gen = torch.Generator().manual_seed(11)
    meta = make_meta([0, 1, 1, -1, 2, 2, 2], [8, 16, 3], empty_segments=1)
    x = torch.randn(7, 32, generator=gen)
    a = torch.randn(2, 3, 16, 32, generator=gen)
    b = torch.randn(3, 24, 16, generator=gen)
    shrunk = torch.zeros(2, 2, 7, 16)  # two K-split partials
    y = torch.randn(7, 24, generator=gen)
    kv = torch.randn(2, 4, 16, 1, 16, generator=gen)
    key, value = torch.randn(3, 1, 16, generator=gen), torch.randn(3, 1, 16, generator=gen)
    args = dict(
        block_tables=torch.tensor([[2, 0], [1, 3]], dtype=torch.int32),
        seq_lens=torch.tensor([20, 9], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32),
        scale=0.25, max_query_len=2, max_seq_len=20,
    )
    query = torch.randn(3, 2, 16, generator=gen)
    with trap_host_reads() as calls:
        lora_shrink_triton(x, a, meta, shrunk)
        lora_shrink_triton(x, a, meta, shrunk, split_k=2)
        lora_shrink_triton(x, a, meta, shrunk, split_k=2, split_reduction="atomic")
        lora_expand_triton(shrunk[0], b, torch.ones(2, 3), (0, 16, 24), meta, y)
        write_kv_cache_triton(key, value, kv, torch.tensor([5, -1, 40]))
        paged_attention_triton(query, kv, **args)
        paged_attention_triton(query, kv, **args, num_kv_splits=2)  # split-KV + merge
        # a layer's calibrated KV-cache scales (host floats) on an fp8 cache
        kv8 = kv.to(torch.float8_e4m3fn)
        write_kv_cache_triton(key, value, kv8, torch.tensor([5, -1, 40]), 0.3, 2.5)
        paged_attention_triton(query, kv8, **args, num_kv_splits=2, k_scale=0.3, v_scale=2.5)
    assert calls == []
