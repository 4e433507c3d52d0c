"""Phi-3 on the Triton path, under the interpreter (CPU tensors, float32): LoRA on the fused
modules runs as one-slice stacks (qkv_proj's B is q 64 + k 32 + v 32 rows), through the
shrink/expand kernels in CUDA-graph decode steps (replayed eagerly), with partial rotary and
LongRoPE; greedy tokens identical to PEFT's model on transformers' ``Phi3ForCausalLM``."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.peft_adapters import make_peft_adapter
from tests.fixtures.tiny_phi3 import longrope_scaling, make_tiny_phi3_dir
from tests.kernels.graph_decode import check_graph_decodes_match_peft

from loraplex.kernels import dispatch  # noqa: E402


@pytest.fixture
def triton_on_cpu(monkeypatch):
    monkeypatch.setattr(dispatch, "uses_triton", lambda t: True)


@pytest.mark.slow
def test_graph_decode_steps_with_fused_lora_match_peft(triton_on_cpu, tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_phi3_dir(tmp_path / "phi3", seed=3, rope_scaling=longrope_scaling(6),
                                   original_max_position_embeddings=64, partial_rotary_factor=0.75)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    adapters = {
        "fused": make_peft_adapter(hf, tmp_path / "fused", seed=41, r=8, lora_alpha=16,
                                   target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
        "qkv": make_peft_adapter(hf, tmp_path / "qkv", seed=42, r=3, target_modules=["qkv_proj"]),
    }
    prompts = [[5, 9, 200, 17, 44], [250, 3, 90], [12, 13, 14, 15, 16, 17, 18]]
    check_graph_decodes_match_peft(model_dir, hf, adapters, prompts, ["fused", None, "qkv"], tmp_path / "home",
                                   max_model_len=64)
