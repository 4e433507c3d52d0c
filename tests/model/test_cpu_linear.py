"""Prepacked CPU linears compute what F.linear computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplex.model import cpu_linear
from loraplex.model.cpu_linear import PrepackedLinear, use_prepacked_linears


@pytest.mark.parametrize("onednn", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 130, cpu_linear.PLAIN_GEMM_MIN_ROWS + 3])  # last: plain path
def test_prepacked_matches_f_linear(monkeypatch, onednn, rows):
    if onednn and not cpu_linear.onednn_linear_available():
        pytest.skip("this torch build has no oneDNN prepacked linear")
    monkeypatch.setattr(cpu_linear, "onednn_linear_available", lambda: onednn)
    torch.manual_seed(0)
    w, b, x = torch.randn(48, 32), torch.randn(48), torch.randn(rows, 32)
    lin = PrepackedLinear(w, b, torch.float32)
    assert (lin.packed is not None) == onednn
    torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_bf16_weights_are_multiplied_as_bf16_values():
    torch.manual_seed(1)
    w, x = torch.randn(40, 24).bfloat16(), torch.randn(7, 24).bfloat16()
    y = PrepackedLinear(w, None, torch.bfloat16)(x)
    assert y.dtype == torch.bfloat16
    expected = F.linear(x.float(), w.float())  # bf16 operands, fp32 accumulation
    torch.testing.assert_close(y.float(), expected.bfloat16().float(), rtol=1e-2, atol=1e-2)


def test_policy():
    assert not use_prepacked_linears("meta", torch.float32)
    assert not use_prepacked_linears("cpu", torch.float16)
    assert use_prepacked_linears("cpu", torch.bfloat16) == (not cpu_linear.native_cpu_bf16())


def test_bf16_weights_keep_no_fp32_copy_for_tall_inputs():
    # the plain-GEMM path for prompt-sized inputs only reuses an fp32 weight; it never copies one
    if not cpu_linear.onednn_linear_available():
        pytest.skip("this torch build has no oneDNN prepacked linear")
    torch.manual_seed(2)
    w = torch.randn(40, 24)
    assert PrepackedLinear(w, None, torch.float32).weight.data_ptr() == w.data_ptr()
    w16 = w.bfloat16()
    lin = PrepackedLinear(w16, None, torch.bfloat16)
    assert lin.weight is None
    x = torch.randn(cpu_linear.PLAIN_GEMM_MIN_ROWS + 1, 24).bfloat16()
    torch.testing.assert_close(lin(x).float(), F.linear(x.float(), w16.float()).bfloat16().float(), rtol=1e-2, atol=1e-2)
