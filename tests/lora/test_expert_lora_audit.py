"""Expert LoRA slots on an MoE model (tiny random Qwen3-MoE, fp32, CPU): a slot rewritten with an
adapter holding fewer experts (a hot-swapped version, or the next adapter in an evicted slot)
keeps nothing of the one before."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex.lora.peft_format import load_adapter_files, validate_adapter
from loraplex.lora.slots import SlotPool
from loraplex.lora.weights import AdapterWeights
from loraplex.model.config import ModelSpec
from tests.fixtures.peft_adapters import make_peft_adapter
from tests.fixtures.tiny_moe import make_tiny_moe_dir

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    model_dir = make_tiny_moe_dir(root / "base", "qwen3_moe", "per_expert", seed=4)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return root, model_dir, base, ModelSpec.from_dir(model_dir).lora_target_spec(expert_lora=True)


def _few_experts_adapter(path, spec):
    """A transformers-4-style adapter with LoRA on experts 1 and 2's gate_proj of layer 0 only, rank 2."""
    import json

    from safetensors.torch import save_file

    h, i = spec.experts.hidden, spec.experts.inter
    gen = torch.Generator().manual_seed(3)
    tensors = {}
    for e in (1, 2):
        key = f"base_model.model.model.layers.0.mlp.experts.{e}.gate_proj"
        tensors[f"{key}.lora_A.weight"] = torch.randn(2, h, generator=gen)
        tensors[f"{key}.lora_B.weight"] = torch.randn(i, 2, generator=gen)
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                          "target_modules": r".*layers\.0\.mlp\.experts\.[12]\.gate_proj"}))
    save_file(tensors, path / "adapter_model.safetensors")
    return path


def test_slot_rewritten_with_fewer_experts_keeps_nothing_of_the_last(moe, tmp_path):
    """All experts of every sparse layer at rank 4 (PEFT's fused form), then an adapter with two
    experts' gate of one layer at rank 2 (a hot-swapped version), into the same slot: every expert
    buffer of the slot equals a fresh pool's holding the second adapter alone."""
    root, _, base, spec = moe
    full = make_peft_adapter(base, root / "full", r=4, seed=5, target_modules=[], target_parameters=EXPERTS)
    few = _few_experts_adapter(tmp_path / "few", spec)

    def weights(path):
        parsed = load_adapter_files(path)
        return AdapterWeights.build(parsed, validate_adapter(parsed, spec, max_lora_rank=4), spec, torch.float32)

    reused = SlotPool(spec, max_loras=1, max_rank=4, device="cpu", dtype=torch.float32)
    reused.write(0, weights(full))
    reused.clear(0)
    reused.write(0, weights(few))
    fresh = SlotPool(spec, max_loras=1, max_rank=4, device="cpu", dtype=torch.float32)
    fresh.write(0, weights(few))
    assert len(reused.experts.tensors()) == len(fresh.experts.tensors()) > 2
    for got, want in zip(reused.experts.tensors(), fresh.experts.tensors()):
        assert torch.equal(got, want)
    assert reused.experts.slot_rank.tolist() == [2]
    assert not reused.experts.layers[2].a_down.any() and reused.experts.layers[0].a_gate_up[0, 0, 1].any()
