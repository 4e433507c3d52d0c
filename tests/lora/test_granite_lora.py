"""Granite (its four multipliers) with PEFT adapters on all seven projections: greedy outputs of
a mixed batch equal PEFT's own model on transformers' ``GraniteForCausalLM``, token for token
(float32). The adapters use the usual module names; nothing Granite-specific on the LoRA side."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex import LLM, SamplingParams
from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.lora.test_acceptance import reference

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("granite")
    model_dir = make_tiny_model_dir(root / "model", "granite", seed=5)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    assert type(base).__name__ == "GraniteForCausalLM"
    dirs = {
        "all": make_peft_adapter(base, root / "all", seed=21, r=8, lora_alpha=16, target_modules=SEVEN),
        "qv": make_peft_adapter(base, root / "qv", seed=22, r=4, target_modules=["q_proj", "v_proj"]),
    }
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=root / "home", max_loras=2, max_lora_rank=8)
    return llm, dirs, peft_model_for(base, dirs)


def test_mixed_batch_matches_peft(world):
    llm, dirs, peft_model = world
    assert sorted(json.loads((dirs["all"] / "adapter_config.json").read_text())["target_modules"]) == sorted(SEVEN)
    prompts = [[5 + (7 * i + j) % 250 for j in range(6 + i)] for i in range(6)]
    which = [None, "all", "qv", "all", None, "qv"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        adapters=[None if w is None else str(dirs[w]) for w in which])
    expected = [reference(peft_model, prompt, adapter) for prompt, adapter in zip(prompts, which)]
    assert [out.token_ids for out in outs] == expected
    # the adapters matter: each changes some prompt's greedy tokens
    for name in ("all", "qv"):
        assert any(reference(peft_model, p, name) != reference(peft_model, p, None) for p in prompts)
