"""vLLM's ``quantization="fp8"`` on an unquantized checkpoint: the projections are quantized to fp8
at load, one scale per output row, and served like an FP8 checkpoint. The reference is
transformers on the weights quantized and dequantized by the test's own code."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from loraplex import LLM, SamplingParams
from loraplex.config import EngineConfig, Settings
from loraplex.model.config import ModelSpec
from loraplex.model.fp8_config import QUANTIZE_AT_LOAD
from loraplex.model.fp8_weights import FP8_DTYPE
from loraplex.model.loader import load_model
from tests.fixtures.fp8_checkpoints import write_fp8_pair
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.fixtures.tiny_moe import moe_hf_config
from tests.lora.test_acceptance import greedy
from tests.model.helpers import chunk_metadata, new_kv_caches, relative_error


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantize-at-load")
    src = make_tiny_model_dir(root / "src", "qwen3", seed=8)
    write_fp8_pair(src, root / "fp8", root / "reference", "ct-channel-fp32")
    return root, src


@pytest.mark.parametrize("resident", [True, False], ids=["dequant-per-matmul", "dequantized-at-load"])
def test_logits_match_transformers_on_the_quantized_weights(dirs, resident):
    root, src = dirs
    spec = ModelSpec.from_dir(src, quantization="fp8")
    assert spec.weight_format == QUANTIZE_AT_LOAD
    ours = load_model(src, spec, torch.float32, "cpu", max_positions=128, fp8_resident=resident)
    ours.prepacked = ours.prepacked_head = None
    assert (ours.layers[0].gate_up_weight.dtype == FP8_DTYPE) == resident
    torch.manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (40,)).tolist()
    positions, attn = chunk_metadata([(0, len(tokens), [2, 0, 1])], 16)
    logits = ours.compute_logits(ours(torch.tensor(tokens), positions, attn, new_kv_caches(spec, 3, 16)))
    with torch.no_grad():
        quantized = AutoModelForCausalLM.from_pretrained(root / "reference", dtype=torch.float32)(
            torch.tensor([tokens])).logits[0]
        unquantized = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(torch.tensor([tokens])).logits[0]
    assert relative_error(logits, quantized) < 1e-4
    assert relative_error(logits, unquantized) > 1e-3  # the weights were quantized: fp8 rounding shows


def test_llm_option_serves_the_quantized_model(dirs):
    root, src = dirs
    llm = LLM(model=str(src), dtype="float32", device="cpu", home=root / "home", quantization="fp8")
    assert llm.engine.runner.spec.weight_format == QUANTIZE_AT_LOAD
    reference = AutoModelForCausalLM.from_pretrained(root / "reference", dtype=torch.float32).eval()
    prompts = [[5 + (3 * i + j) % 200 for j in range(5 + i)] for i in range(3)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == greedy(reference, prompt, 6)


def test_fp8_checkpoint_is_read_as_stored_with_the_option(dirs):
    root, _ = dirs
    stored = ModelSpec.from_dir(root / "fp8").weight_format
    assert ModelSpec.from_dir(root / "fp8", quantization="fp8").weight_format == stored != QUANTIZE_AT_LOAD


@pytest.mark.parametrize("value", ["awq", "gptq", "fp8_e5m2", ""])
def test_other_quantization_values_are_refused_at_start(value):
    with pytest.raises(ValueError, match=f"quantization={value!r} is not served"):
        EngineConfig(quantization=value)
    with pytest.raises(ValidationError, match="is not served"):
        Settings(quantization=value)


def test_quantizing_an_moe_at_load_is_read():
    """Served: tests/model/test_moe_fp8.py::test_unquantized_moe_quantized_at_load."""
    cfg = {**moe_hf_config("qwen3_moe").to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}
    assert ModelSpec.from_dict(cfg, quantization="fp8").weight_format == QUANTIZE_AT_LOAD
