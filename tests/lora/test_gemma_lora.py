"""Gemma 2 and Gemma 3 with PEFT adapters on the usual seven projections: greedy outputs of a
batch mixing the base model and three adapters equal PEFT's own model on transformers' Gemma,
token for token (float32). Prompts and outputs run past the tiny models' 24-position window."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex import LLM, SamplingParams
from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.lora.test_acceptance import reference

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def world(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model_dir = make_tiny_model_dir(root / "model", request.param, seed=5)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()
    dirs = {
        "all": make_peft_adapter(base, root / "all", seed=21, r=8, lora_alpha=16, target_modules=SEVEN),
        "qv": make_peft_adapter(base, root / "qv", seed=22, r=4, target_modules=["q_proj", "v_proj"]),
        "mlp_rslora": make_peft_adapter(base, root / "mlp", seed=23, r=2, lora_alpha=3, use_rslora=True,
                                        target_modules=["gate_proj", "up_proj", "down_proj"]),
    }
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=root / "home", max_loras=3, max_lora_rank=8,
              max_num_batched_tokens=64)  # long prompts are chunked
    return llm, dirs, peft_model_for(base, dirs)


def test_mixed_batch_matches_peft(world):
    llm, dirs, peft_model = world
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(4, 300, (n,), generator=gen).tolist() for n in (6, 30, 11, 45, 20, 8, 70, 3)]
    which = [None, "all", "qv", "mlp_rslora", "all", "qv", "mlp_rslora", None]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        adapters=[None if w is None else str(dirs[w]) for w in which])
    expected = [reference(peft_model, prompt, adapter) for prompt, adapter in zip(prompts, which)]
    assert [out.token_ids for out in outs] == expected
    # the adapters matter: each changes the greedy tokens of some prompt it serves above
    base = {i: reference(peft_model, prompts[i], None) for i in range(len(prompts))}
    for name in dirs:
        assert any(expected[i] != base[i] for i in range(len(prompts)) if which[i] == name), name
