"""A checkpoint that carries calibrated KV-cache scales (``self_attn.k_scale`` / ``v_scale``, as
llm-compressor and ModelOpt write them for vLLM's fp8 KV cache) loads, and the start-up log says
that they are not read and that the fp8 cache uses a scale of 1.0: never dropped silently."""

from __future__ import annotations

import logging

import torch
from safetensors.torch import load_file, save_file

from loraplex.engine.llm import LLM
from tests.fixtures.tiny_models import make_tiny_model_dir


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
