"""An FP8 checkpoint on the CPU prepacked path keeps only what that path runs: the fp32 prepacked
copies of its projections. The fp8 weights and their scales were kept beside them; now they are
released once packed. Measured as the bytes the model holds (parameters, buffers and prepacked
copies, each storage once), and the drop is held to the fp8 bytes and scales the checkpoint's
shapes give (one byte per weight, one fp32 scale per row and 16-column block)."""

from __future__ import annotations

import pytest
import torch

from loraplex.model.config import ModelSpec
from loraplex.model.cpu_linear import use_prepacked_linears
from loraplex.model.fp8_weights import FP8_DTYPE
from loraplex.model.loader import load_model
from tests.fixtures.fp8_checkpoints import write_fp8_pair
from tests.fixtures.tiny_models import make_tiny_model_dir

pytestmark = pytest.mark.skipif(not use_prepacked_linears("cpu", torch.float32),
                                reason="no oneDNN prepacked GEMM on this build")


def held_tensors(model) -> list[torch.Tensor]:
    """Every tensor the model keeps memory for, each storage once (a meta tensor keeps none)."""
    tensors = [*model.parameters(), *model.buffers()]
    for linear in [*(lin for layer in model.prepacked for lin in layer.values()), model.prepacked_head]:
        tensors += [t for t in (linear.packed, linear.weight, linear.bias) if t is not None]
    seen, out = set(), []
    for t in tensors:
        key = id(t) if t.is_mkldnn else t.untyped_storage().data_ptr() if not t.is_meta else None
        if key is None or key in seen:
            continue
        seen.add(key)
        out.append(t)
    return out


def resident_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in held_tensors(model))


def fp8_bytes_from_shapes(spec: ModelSpec, block_cols: int) -> int:
    """The fp8 weights (1 byte each) and fp32 scales ([out, ceil(in / block_cols)]) of every
    projection, from the model's shapes."""
    h, i = spec.hidden_size, spec.intermediate_size
    shapes = [(spec.q_size + 2 * spec.kv_size, h), (h, spec.q_size), (2 * i, h), (h, i)]
    per_layer = sum(out * inp + 4 * out * -(-inp // block_cols) for out, inp in shapes)
    return spec.num_layers * per_layer


def test_prepacked_cpu_path_holds_no_fp8_copy(tmp_path):
    src = make_tiny_model_dir(tmp_path / "src", "llama", seed=5)
    write_fp8_pair(src, tmp_path / "fp8", tmp_path / "ref", "fp8-block")  # 16x16 blocks, every projection
    spec = ModelSpec.from_dir(tmp_path / "fp8")
    # before: the fp8 weights kept beside their prepacked copies (what an explicit fp8_resident keeps)
    both = load_model(tmp_path / "fp8", spec, torch.float32, "cpu", max_positions=64, fp8_resident=True)
    ours = load_model(tmp_path / "fp8", spec, torch.float32, "cpu", max_positions=64)
    assert ours.prepacked is not None and both.prepacked is not None
    assert not any(t.dtype == FP8_DTYPE for t in held_tensors(ours))
    assert any(t.dtype == FP8_DTYPE for t in held_tensors(both))
    # the shapes stay readable: the weight is still described as the stored fp8 projection
    assert ours.layers[0].qkv_weight.dtype == FP8_DTYPE and ours.layers[0].qkv_weight.is_meta
    assert ours.layers[0].qkv_weight.shape == both.layers[0].qkv_weight.shape
    before, after = resident_bytes(both), resident_bytes(ours)
    assert before - after == fp8_bytes_from_shapes(spec, 16)
    print(f"tiny fp8 llama, CPU prepacked: {before} bytes held before, {after} after")
