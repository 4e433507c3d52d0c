"""Loading an FP8 MoE checkpoint on CPU, where the stacked experts are dequantized once at load:
each fp8 weight is released as soon as its dequantized copy exists, so loading peaks near the
dequantized model plus one fp8 tensor, not the dequantized model plus every fp8 byte (the whole
fp8 checkpoint, ~29 GiB of Qwen3-30B-A3B-FP8's experts, was held until the last expert was
dequantized). Checked on the tensors the loader hands to ``dequantize``: when it dequantizes one,
none handed before may still be alive. The outputs are unchanged (the stored fp8 times its scale).
The same for ``quantization="fp8"`` on an unquantized MoE, whose weights are quantized at load."""

from __future__ import annotations

import weakref

import torch

from loraplex.model import loader
from loraplex.model.config import ModelSpec
from loraplex.model.fp8_weights import dequantize, quantize_per_channel
from tests.fixtures.fp8_checkpoints import write_fp8_pair
from tests.fixtures.tiny_moe import make_tiny_moe_dir


def test_each_fp8_expert_weight_is_freed_once_dequantized(tmp_path, monkeypatch):
    src = make_tiny_moe_dir(tmp_path / "src", "qwen3_moe", "per_expert", seed=3)
    write_fp8_pair(src, tmp_path / "fp8", tmp_path / "reference", "fp8-block")
    handed: list[weakref.ref] = []
    alive_at_call: list[int] = []
    expected: dict[int, torch.Tensor] = {}

    def tracking_dequantize(weight, scale, dtype, block_cols):
        alive_at_call.append(sum(ref() is not None for ref in handed))
        out = dequantize(weight, scale, dtype, block_cols)
        handed.append(weakref.ref(weight))
        expected[len(handed)] = out
        return out

    monkeypatch.setattr(loader, "dequantize", tracking_dequantize)
    spec = ModelSpec.from_dir(tmp_path / "fp8")
    model = loader.load_model(tmp_path / "fp8", spec, torch.float32, "cpu", max_positions=64)
    assert len(handed) >= 4  # two stacked expert weights per sparse layer, at least two layers
    assert alive_at_call == [0] * len(alive_at_call)
    assert all(ref() is None for ref in handed)
    # the model holds the dequantized experts themselves (no fp8 left behind on them)
    layer = model.layers[0]
    assert layer.experts_gate_up.dtype == torch.float32
    assert getattr(layer, "experts_gate_up_scale", None) is None
    assert any(torch.equal(layer.experts_gate_up, t) for t in expected.values())


def test_quantize_at_load_frees_each_full_precision_weight_once_quantized(tmp_path, monkeypatch):
    """``quantization="fp8"`` on an unquantized MoE: each projection and stacked expert weight is
    released once its fp8 copy exists (they were all held beside all the fp8 copies until the last)."""
    src = make_tiny_moe_dir(tmp_path / "src", "qwen3_moe", "per_expert", seed=4)
    handed: list[weakref.ref] = []
    alive_at_call: list[int] = []

    def tracking_quantize(weight):
        alive_at_call.append(sum(ref() is not None for ref in handed))
        out = quantize_per_channel(weight)
        handed.append(weakref.ref(weight))
        return out

    monkeypatch.setattr(loader, "quantize_per_channel", tracking_quantize)
    spec = ModelSpec.from_dir(src, quantization="fp8")
    model = loader.load_model(src, spec, torch.float32, "cpu", max_positions=64, fp8_resident=True)
    assert len(handed) >= 8 and alive_at_call == [0] * len(alive_at_call)
    assert model.layers[0].experts_gate_up.dtype == torch.float8_e4m3fn
