"""Qwen3 (q/k norms, q wider than the hidden size) with PEFT adapters on every projection: greedy
outputs of a mixed batch equal PEFT's own model, token for token (float32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex import LLM, SamplingParams
from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.lora.test_acceptance import reference


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    model_dir = make_tiny_model_dir(root / "model", "qwen3", seed=3)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    dirs = {
        "all": make_peft_adapter(base, root / "all", seed=11, r=8, target_modules="all-linear"),
        "qv": make_peft_adapter(base, root / "qv", seed=12, r=4, target_modules=["q_proj", "v_proj"]),
    }
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=root / "home", max_loras=2, max_lora_rank=8)
    return llm, dirs, peft_model_for(base, dirs)


def test_mixed_batch_matches_peft(world):
    llm, dirs, peft_model = world
    prompts = [[5 + (7 * i + j) % 250 for j in range(6 + i)] for i in range(6)]
    which = [None, "all", "qv", "all", None, "qv"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        adapters=[None if w is None else str(dirs[w]) for w in which])
    for prompt, adapter, out in zip(prompts, which, outs):
        assert out.token_ids == reference(peft_model, prompt, adapter)
