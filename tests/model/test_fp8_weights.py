"""FP8 checkpoints (quant_method fp8 and compressed-tensors float-quantized) against transformers
on the same model's dequantized weights: logits of a prefill and of a mixed prefill + decode step,
on each path: the CPU prepacked GEMM (dequantized to fp32 at load), fp8 kept resident and
dequantized at each matmul (what CUDA runs; forced here on CPU), and dequantized to the model
dtype at load (a CPU without the prepacked GEMM)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex.model.config import ModelSpec
from loraplex.model.fp8_weights import FP8_DTYPE
from loraplex.model.loader import load_model, read_safetensors
from tests.fixtures.fp8_checkpoints import SCHEMES, write_fp8_pair
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.fixtures.tiny_phi3 import make_tiny_phi3_dir
from tests.model.helpers import chunk_metadata, new_kv_caches, relative_error

BLOCK_SIZE = 16
CASES = {  # name -> (model kind, scheme)
    "llama-fp8-block": ("llama", "fp8-block"),
    "qwen3-fp8-block": ("qwen3", "fp8-block"),
    "llama-fp8-tensor": ("llama", "fp8-tensor"),
    "qwen2-ct-channel": ("qwen2", "ct-channel"),
    "llama-ct-tensor": ("llama", "ct-tensor"),
    "qwen3-ct-block": ("qwen3", "ct-block"),
    "gemma2-fp8-block": ("gemma2", "fp8-block"),
    "phi3-fused-ct-tensor": ("phi3", "ct-tensor"),  # one scale for the fused qkv_proj / gate_up_proj
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    kind, scheme = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    if kind == "phi3":
        src = make_tiny_phi3_dir(root / "src", seed=5)
    else:
        src = make_tiny_model_dir(root / "src", kind, seed=5)
    write_fp8_pair(src, root / "fp8", root / "reference", scheme)
    ref = AutoModelForCausalLM.from_pretrained(root / "reference", dtype=torch.float32).eval()
    return root / "fp8", scheme, ref


PATHS = ("prepacked", "dequant-per-matmul", "dequantized-at-load")


def _load(model_dir, path: str):
    spec = ModelSpec.from_dir(model_dir)
    model = load_model(model_dir, spec, torch.float32, "cpu", max_positions=512,
                       fp8_resident=None if path == "prepacked" else path == "dequant-per-matmul")
    if path != "prepacked":  # no prepacked copies: the model's own weights run
        model.prepacked = model.prepacked_head = None
    return spec, model


def _ref_logits(ref, tokens: list[int]) -> torch.Tensor:  # [len, vocab]
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("path", PATHS)
def test_prefill_and_mixed_step_match_transformers_on_dequantized_weights(pair, path):
    model_dir, scheme, ref = pair
    spec, ours = _load(model_dir, path)
    assert (ours.layers[0].qkv_weight.dtype == FP8_DTYPE) == (path != "dequantized-at-load")
    torch.manual_seed(0)
    seq_a = torch.randint(0, spec.vocab_size, (45,)).tolist()
    seq_b = torch.randint(0, spec.vocab_size, (18,)).tolist()
    tables = {"a": [3, 8, 1], "b": [6, 0]}
    kv = new_kv_caches(spec, 10, BLOCK_SIZE)
    positions, attn = chunk_metadata([(0, 20, tables["a"]), (0, 17, tables["b"])], BLOCK_SIZE)
    prefill = ours.compute_logits(ours(torch.tensor(seq_a[:20] + seq_b[:17]), positions, attn, kv))
    expected = torch.cat([_ref_logits(ref, seq_a[:20]), _ref_logits(ref, seq_b[:17])])
    assert relative_error(prefill, expected) < 1e-4
    # A's next chunk over its cached prefix and one decode of B
    positions, attn = chunk_metadata([(20, 25, tables["a"]), (17, 1, tables["b"])], BLOCK_SIZE)
    step = ours.compute_logits(ours(torch.tensor(seq_a[20:45] + seq_b[17:18]), positions, attn, kv))
    expected = torch.cat([_ref_logits(ref, seq_a)[20:45], _ref_logits(ref, seq_b)[17:18]])
    assert relative_error(step, expected) < 1e-4


def test_projections_stay_fp8_with_per_part_scales(pair):
    """The packed weights are the stored fp8 bytes (one byte each), the scales fp32 per row."""
    model_dir, scheme, _ = pair
    spec, ours = _load(model_dir, "dequant-per-matmul")
    raw = read_safetensors(model_dir)
    layer = ours.layers[0]
    fused = raw.get("model.layers.0.self_attn.qkv_proj.weight")  # Phi-3 stores qkv_proj fused
    stored = fused if fused is not None else torch.cat(
        [raw[f"model.layers.0.self_attn.{m}_proj.weight"] for m in "qkv"])
    assert torch.equal(layer.qkv_weight.view(torch.uint8), stored.view(torch.uint8))
    assert layer.qkv_weight.dtype == FP8_DTYPE and layer.qkv_weight.element_size() == 1
    assert layer.qkv_weight_scale.dtype == torch.float32
    assert layer.qkv_weight_scale.shape[0] == spec.q_size + 2 * spec.kv_size
    if SCHEMES[scheme][1][0].startswith("tensor") and fused is None:  # each part's scalar on its own rows
        suffix = SCHEMES[scheme][2]
        parts = [raw[f"model.layers.0.self_attn.{m}_proj.{suffix}"].float().reshape(()) for m in "qkv"]
        sizes = [spec.q_size, spec.kv_size, spec.kv_size]
        assert torch.equal(layer.qkv_weight_scale[:, 0], torch.cat([s.expand(n) for s, n in zip(parts, sizes)]))
        assert len(set(p.item() for p in parts)) == 3  # the test means something: the scales differ


def test_ignored_modules_stay_unquantized(tmp_path):
    """compressed-tensors' ``ignore``: lm_head and one down_proj are stored (and served) in full
    precision; every other projection is fp8."""
    src = make_tiny_model_dir(tmp_path / "src", "qwen2", seed=2)
    write_fp8_pair(src, tmp_path / "fp8", tmp_path / "ref", "ct-channel")
    _, ours = _load(tmp_path / "fp8", "dequant-per-matmul")
    hf = read_safetensors(src)
    assert ours.lm_head.dtype == torch.float32 and torch.equal(ours.lm_head, hf["lm_head.weight"])
    assert ours.layers[1].down_weight.dtype == torch.float32
    assert torch.equal(ours.layers[1].down_weight, hf["model.layers.1.mlp.down_proj.weight"])
    assert getattr(ours.layers[1], "down_weight_scale", None) is None
    assert ours.layers[0].down_weight.dtype == FP8_DTYPE and ours.layers[1].gate_up_weight.dtype == FP8_DTYPE


@pytest.mark.parametrize("resident", [True, False], ids=["dequant-per-matmul", "dequantized-at-load"])
def test_bfloat16_dequantized_weights_are_the_reference_rounded_once(tmp_path, resident):
    """In bf16 the dequantization rounds the product of the fp8 value and the bf16 scale once
    (compressed-tensors stores bf16 scales, so the product is exact before that rounding): the
    weights the matmuls use are the reference weights rounded to bf16."""
    src = make_tiny_model_dir(tmp_path / "src", "llama", seed=4)
    write_fp8_pair(src, tmp_path / "fp8", tmp_path / "ref", "ct-channel")
    spec = ModelSpec.from_dir(tmp_path / "fp8")
    ours = load_model(tmp_path / "fp8", spec, torch.bfloat16, "cpu", max_positions=64, fp8_resident=resident)
    assert (ours.layers[0].qkv_weight.dtype == FP8_DTYPE) == resident
    ref = read_safetensors(tmp_path / "ref")
    for name, parts in (("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                        ("gate_up", ("mlp.gate_proj", "mlp.up_proj"))):
        expected = torch.cat([ref[f"model.layers.0.{p}.weight"] for p in parts]).to(torch.bfloat16)
        assert torch.equal(ours.linear_weight(0, name, torch.bfloat16), expected)
