"""A checkpoint that carries calibrated KV-cache scales (``self_attn.k_scale`` / ``v_scale``, as
llm-compressor and ModelOpt write them for vLLM's fp8 KV cache) loads, and the start-up log says
that they are not read and that the fp8 cache uses a scale of 1.0: never dropped silently. A
compressed-tensors checkpoint that quantizes the KV cache alone (plain weights) is served."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from loraplex.engine.llm import LLM
from loraplex.model.config import ModelSpec, UnsupportedModelError
from loraplex.sampling_params import SamplingParams
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.lora.test_acceptance import greedy


def test_calibrated_kv_scales_are_named_as_not_read(tmp_path, caplog):
    model_dir = make_tiny_model_dir(tmp_path / "m", "llama", seed=2)
    (weights,) = model_dir.glob("*.safetensors")
    tensors = load_file(weights)
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.5)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.25)
    save_file(tensors, weights, metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="loraplex.model.loader"):
        LLM(model=str(model_dir), dtype="float32", device="cpu", home=tmp_path / "home", kv_cache_dtype="fp8",
            kv_cache_bytes=1 << 20)
    messages = [r.getMessage() for r in caplog.records if r.name == "loraplex.model.loader"]
    (scales,) = [m for m in messages if "KV-cache scales are not read" in m]
    assert "4 tensors" in scales and "self_attn.k_scale" in scales and "scale of 1.0" in scales
    assert not any("unexpected tensors" in m for m in messages)  # not mixed into the generic leftovers


KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
INT8_WEIGHTS = {"num_bits": 8, "type": "int", "strategy": "channel", "dynamic": False, "symmetric": True}


def _with_kv_scales(model_dir, quantization_config: dict) -> None:
    """Add llm-compressor's per-layer K/V scales and ``quantization_config`` to a saved checkpoint."""
    (weights,) = model_dir.glob("*.safetensors")
    tensors = load_file(weights)
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.5)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.25)
    save_file(tensors, weights, metadata={"format": "pt"})
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "quantization_config": quantization_config}))


@pytest.mark.parametrize("config_groups", [
    {},  # transformers#33874: a kv_cache_scheme-only config
    {"group_0": {"targets": [], "weights": None, "input_activations": None, "output_activations": None}},
])
def test_kv_cache_only_compressed_tensors_checkpoint_is_served(tmp_path, config_groups):
    """compressed-tensors writes a quantization_config for a recipe that quantizes the KV cache
    only (compressed-tensors#135): the weights are plain, vLLM serves it, and so does loraplex,
    with transformers' greedy tokens."""
    model_dir = make_tiny_model_dir(tmp_path / "m", "llama", seed=2)
    prompt = [5, 17, 99, 3, 42]
    # the reference before the checkpoint gains its quantization_config (transformers would want
    # the compressed-tensors package for it)
    want = greedy(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval(), prompt, 6)
    _with_kv_scales(model_dir, {"quant_method": "compressed-tensors", "format": "dense",
                                "config_groups": config_groups, "kv_cache_scheme": KV_SCHEME})
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=tmp_path / "home", kv_cache_bytes=1 << 20)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert out.outputs[0].token_ids == want


def test_weights_quantized_with_a_kv_scheme_are_still_refused(tmp_path):
    """Integer weights with a KV scheme: the weights decide (fp8 ones are served, int8 refused)."""
    model_dir = make_tiny_model_dir(tmp_path / "m", "llama", seed=2)
    _with_kv_scales(model_dir, {"quant_method": "compressed-tensors", "format": "int-quantized",
                                "config_groups": {"group_0": {"targets": ["Linear"], "weights": INT8_WEIGHTS}},
                                "kv_cache_scheme": KV_SCHEME})
    with pytest.raises(UnsupportedModelError, match="quant_method='compressed-tensors'"):
        ModelSpec.from_dir(model_dir)
