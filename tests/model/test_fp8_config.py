"""FP8 ``quantization_config``s as published checkpoints write them, and the clear errors for what
is not served: malformed or missing scales, mixed packed projections (FP8 MoE configs are read: served,
tests/model/test_moe_fp8.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.model.config import ModelSpec
from loraplex.model.loader import load_model
from tests.fixtures.fp8_checkpoints import write_fp8_pair
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.fixtures.tiny_moe import moe_hf_config

# Qwen/Qwen3-8B-FP8's config.json (transformers FineGrainedFP8 / DeepSeek-V3 style)
QWEN3_FP8 = {"activation_scheme": "dynamic", "modules_to_not_convert": ["lm_head"], "fmt": "e4m3",
             "quant_method": "fp8", "weight_block_size": [128, 128]}
# AutoFP8's (neuralmagic/Meta-Llama-3-8B-Instruct-FP8): per-tensor scales, static activation scales
AUTOFP8 = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
# llm-compressor's FP8 (RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8): per tensor, static activations
CT_FP8 = {
    "config_groups": {"group_0": {
        "input_activations": {"block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
                              "observer": "minmax", "strategy": "tensor", "symmetric": True, "type": "float"},
        "output_activations": None, "targets": ["Linear"],
        "weights": {"block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
                    "observer": "minmax", "strategy": "tensor", "symmetric": True, "type": "float"}}},
    "format": "float-quantized", "global_compression_ratio": 1.24, "ignore": ["lm_head"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}


def _llama_cfg(tiny_llama_dir, quant) -> dict:
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    return {**cfg, "quantization_config": quant}


@pytest.mark.parametrize("quant, strategy, block, scheme", [
    (QWEN3_FP8, "block", (128, 128), "dynamic"),
    (AUTOFP8, "tensor", None, "static"),
    (CT_FP8, "tensor", None, "static"),
    ({**CT_FP8, "config_groups": {"group_0": {
        **CT_FP8["config_groups"]["group_0"],
        "weights": {**CT_FP8["config_groups"]["group_0"]["weights"], "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}},
     "channel", None, "dynamic"),
])
def test_published_fp8_configs_are_read(tiny_llama_dir, quant, strategy, block, scheme):
    fmt = ModelSpec.from_dict(_llama_cfg(tiny_llama_dir, quant)).weight_format
    assert (fmt.strategy, fmt.block_size, fmt.activation_scheme) == (strategy, block, scheme)
    assert "lm_head" in fmt.ignore


def test_fp8_moe_is_read():
    """Qwen3-30B-A3B-FP8's quantization_config on an MoE: served (tests/model/test_moe_fp8.py)."""
    cfg = {**moe_hf_config("mixtral").to_dict(), "architectures": ["MixtralForCausalLM"],
           "quantization_config": QWEN3_FP8}
    spec = ModelSpec.from_dict(cfg)
    assert spec.moe is not None and spec.weight_format.block_size == (128, 128)


def _edit_weights(model_dir, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.0.self_attn.k_proj.weight_scale_inv"), "no weight_scale_inv or weight_scale"),
    (lambda t: t.update({"model.layers.0.mlp.down_proj.weight_scale_inv": torch.ones(3, 3)}), "block scale of shape"),
    (lambda t: t.update({"model.layers.0.self_attn.v_proj.weight":
                         t["model.layers.0.self_attn.v_proj.weight"].float()}), "packed projection"),
    (lambda t: t.update({"model.layers.1.self_attn.o_proj.weight":
                         t["model.layers.1.self_attn.o_proj.weight"].float().to(torch.float8_e5m2)}),
     "only float8_e4m3fn"),
])
def test_malformed_fp8_checkpoint_fails_clearly(tmp_path, edit, message):
    src = make_tiny_model_dir(tmp_path / "src", "llama", seed=1)
    write_fp8_pair(src, tmp_path / "fp8", tmp_path / "ref", "fp8-block")
    shutil.rmtree(tmp_path / "ref")
    _edit_weights(tmp_path / "fp8", edit)
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path / "fp8", ModelSpec.from_dir(tmp_path / "fp8"), torch.float32, "cpu", 64)


def test_adapters_are_checked_against_the_unquantized_shapes(tmp_path):
    """The registry validates an upload against the base model's LoRA target shapes
    (``base_model_spec``, from its config.json): an FP8 checkpoint's are its unquantized model's."""
    from dataclasses import replace
    from types import SimpleNamespace

    from loraplex.registry.base_model import base_model_spec

    src = make_tiny_model_dir(tmp_path / "src", "qwen3", seed=1)
    write_fp8_pair(src, tmp_path / "fp8", tmp_path / "ref", "fp8-block")
    fp8 = base_model_spec(SimpleNamespace(model=str(tmp_path / "fp8"), home=tmp_path / "home"))
    plain = base_model_spec(SimpleNamespace(model=str(src), home=tmp_path / "home"))
    assert fp8.model_name == "fp8" and replace(fp8, model_name="m") == replace(plain, model_name="m")
