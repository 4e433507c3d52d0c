"""A checkpoint's calibrated KV-cache scales (per layer ``k_scale`` / ``v_scale``, as llm-compressor,
compressed-tensors and ModelOpt write them for vLLM's fp8 KV cache): with an fp8 cache the loader
reads them under every name vLLM accepts (``weight_utils.maybe_remap_kv_scale_name``, the
quantization configs' ``get_cache_scale``) with vLLM's rules (one of the two stands for both;
``kv_scale`` for both; none: 1.0), refuses unusable ones naming the tensor, and with
``kv_cache_dtype`` auto reads past them and says so, as vLLM applies them only to an fp8 cache. A
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
from loraplex.model.kv_scales import KVScaleError
from loraplex.model.loader import load_model
from loraplex.sampling_params import SamplingParams
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.lora.test_acceptance import greedy

LAYERS = 2


def add_tensors(model_dir, tensors: dict[str, torch.Tensor]) -> None:
    (weights,) = model_dir.glob("*.safetensors")
    save_file({**load_file(weights), **tensors}, weights, metadata={"format": "pt"})


def load(model_dir, kv_cache_dtype: str):
    return load_model(model_dir, ModelSpec.from_dir(model_dir), torch.float32, "cpu", 64,
                      kv_cache_dtype=kv_cache_dtype)


@pytest.fixture
def model_dir(tmp_path):
    return make_tiny_model_dir(tmp_path / "m", "llama", seed=2)


# (names per layer under model.layers.{i}.self_attn. -> which of k / v each stands for)
NAMINGS = {
    "llm_compressor": {"k_scale": "k", "v_scale": "v"},
    "modelopt": {"k_proj.k_scale": "k", "v_proj.v_scale": "v"},
    "qkv_proj": {"qkv_proj.k_scale": "k", "qkv_proj.v_scale": "v"},
    "compressed_tensors_output_scale": {"k_proj.output_scale": "k", "v_proj.output_scale": "v"},
    "deprecated_kv_scale": {"kv_scale": "kv"},
    "k_only": {"k_scale": "k"},
    "v_only": {"v_proj.v_scale": "v"},
}


@pytest.mark.parametrize("naming", list(NAMINGS))
@pytest.mark.parametrize("shape", [(), (1,)])
def test_scale_names_vllm_reads_are_read(model_dir, naming, shape, caplog):
    tensors, want = {}, []
    for i in range(LAYERS):
        values = {"k": 0.5 + i, "v": 3.25 * (i + 1)}
        values["kv"] = values["k"]
        for name, role in NAMINGS[naming].items():
            tensors[f"model.layers.{i}.self_attn.{name}"] = torch.full(shape, values[role], dtype=torch.bfloat16)
        roles = set(NAMINGS[naming].values())
        # vLLM's process_weights_after_loading: a lone scale (or kv_scale) stands for both
        k = values["k"] if roles & {"k", "kv"} else values["v"]
        v = values["v"] if "v" in roles else k
        want.append((k, v))
    add_tensors(model_dir, tensors)
    with caplog.at_level(logging.INFO, logger="loraplex.model.loader"):
        model = load(model_dir, "fp8")
    assert model.kv_scales == want
    messages = [r.getMessage() for r in caplog.records if r.name == "loraplex.model.loader"]
    assert any("KV-cache scales: calibrated" in m for m in messages), messages
    assert not any("unexpected tensors" in m for m in messages)


def test_a_layer_without_scales_keeps_one(model_dir):
    add_tensors(model_dir, {"model.layers.1.self_attn.k_scale": torch.tensor(2.0),
                            "model.layers.1.self_attn.v_scale": torch.tensor(4.0)})
    assert load(model_dir, "fp8_e5m2").kv_scales == [(1.0, 1.0), (2.0, 4.0)]


def test_no_scales_is_one_on_every_layer_and_said(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="loraplex.model.loader"):
        assert load(model_dir, "fp8").kv_scales == [(1.0, 1.0)] * LAYERS
    (line,) = [r for r in caplog.records if "KV-cache scales" in r.getMessage()]
    assert "not calibrated" in line.getMessage() and line.levelno == logging.WARNING  # as vLLM warns for e4m3


@pytest.mark.parametrize("value,shape,why", [
    (float("nan"), (), "finite positive"), (float("inf"), (), "finite positive"), (0.0, (), "finite positive"),
    (-1.0, (), "finite positive"), (0.5, (2,), "per-head scales"),
])
def test_unusable_scales_are_refused_naming_the_tensor(model_dir, value, shape, why):
    add_tensors(model_dir, {"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
                            "model.layers.1.self_attn.v_proj.v_scale": torch.full(shape, value)})
    with pytest.raises(UnsupportedModelError, match=why) as err:
        load(model_dir, "fp8")
    assert isinstance(err.value, KVScaleError) and "'layers.1.self_attn.v_proj.v_scale'" in str(err.value)


@pytest.mark.parametrize("second,why", [("k_proj.output_scale", "two KV-cache scales for one role"),
                                        ("kv_scale", "one or the other")])
def test_two_names_for_one_scale_are_refused(model_dir, second, why):
    add_tensors(model_dir, {"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
                            f"model.layers.0.self_attn.{second}": torch.tensor(0.5)})
    with pytest.raises(KVScaleError, match=why):
        load(model_dir, "fp8")


def test_auto_cache_reads_past_the_scales_and_says_so(model_dir, tmp_path, caplog):
    """vLLM: "If the kv-cache dtype is auto, we enforce the k/v_scale to be 1.0 regardless whether
    the kv-scale is available in the checkpoint"; not even a broken one stops the start."""
    add_tensors(model_dir, {f"model.layers.{i}.self_attn.{n}": torch.tensor(v)
                            for i in range(LAYERS) for n, v in (("k_scale", 0.5), ("v_scale", float("nan")))})
    with caplog.at_level(logging.INFO, logger="loraplex.model.loader"):
        llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=tmp_path / "home", kv_cache_bytes=1 << 20)
    assert llm.engine.runner.model.kv_scales == [(1.0, 1.0)] * LAYERS
    messages = [r.getMessage() for r in caplog.records if r.name == "loraplex.model.loader"]
    (line,) = [m for m in messages if "KV-cache scales" in m]
    assert "4 calibrated scale tensors" in line and "not used" in line and "kv_cache_dtype auto" in line
    assert not any("unexpected tensors" in m for m in messages)


def test_the_engine_runs_on_the_checkpoint_scales(model_dir, tmp_path):
    add_tensors(model_dir, {f"model.layers.{i}.self_attn.{n}": torch.tensor(v)
                            for i in range(LAYERS) for n, v in (("k_scale", 0.5 + i), ("v_scale", 0.25))})
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=tmp_path / "home", kv_cache_dtype="fp8",
              kv_cache_bytes=1 << 20)
    assert llm.engine.runner.model.kv_scales == [(0.5, 0.25), (1.5, 0.25)]


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
