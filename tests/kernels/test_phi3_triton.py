"""Phi-3 on the Triton path, under the interpreter (CPU tensors, float32): LoRA on the fused
modules runs as one-slice stacks (qkv_proj's B is q 64 + k 32 + v 32 rows), through the
shrink/expand kernels in CUDA-graph decode steps (replayed eagerly), with partial rotary and
LongRoPE; greedy tokens identical to PEFT's model on transformers' ``Phi3ForCausalLM``."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for
from tests.fixtures.tiny_phi3 import longrope_scaling, make_tiny_phi3_dir
from tests.lora.test_acceptance import reference

from loraplex.kernels import dispatch  # noqa: E402
from loraplex.sampling_params import SamplingParams  # noqa: E402


@pytest.fixture
def triton_on_cpu(monkeypatch):
    monkeypatch.setattr(dispatch, "uses_triton", lambda t: True)


@pytest.mark.slow
def test_graph_decode_steps_with_fused_lora_match_peft(triton_on_cpu, tmp_path):
    from transformers import AutoModelForCausalLM

    from loraplex.engine.cuda_graphs import DecodeGraphs, eager_capture
    from loraplex.engine.llm import LLM

    model_dir = make_tiny_phi3_dir(tmp_path / "phi3", seed=3, rope_scaling=longrope_scaling(6),
                                   original_max_position_embeddings=64, partial_rotary_factor=0.75)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    adapters = {
        "fused": make_peft_adapter(hf, tmp_path / "fused", seed=41, r=8, lora_alpha=16,
                                   target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
        "qkv": make_peft_adapter(hf, tmp_path / "qkv", seed=42, r=3, target_modules=["qkv_proj"]),
    }
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=tmp_path / "home",
              kv_cache_bytes=1 << 20, max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=64)
    for name, path in adapters.items():
        llm.add_adapter(name, str(path))
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, runner.max_model_len, 4, eager_capture)
    runner.decode_graphs = graphs
    peft_model = peft_model_for(hf, adapters)
    prompts = [[5, 9, 200, 17, 44], [250, 3, 90], [12, 13, 14, 15, 16, 17, 18]]
    which = ["fused", None, "qkv"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), adapters=which)
    assert [o.token_ids for o in outs] == [reference(peft_model, p, a, 5) for p, a in zip(prompts, which)]
    assert sum(g.graph.replays for g in graphs.graphs.values()) >= 3  # the decodes ran as graphs
    assert any(seg_class > 0 for _, seg_class in graphs.graphs)  # with the LoRA kernels
