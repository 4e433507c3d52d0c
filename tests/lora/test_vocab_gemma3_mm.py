"""LoRA on embed_tokens and lm_head of a multimodal Gemma 3 (``Gemma3ForConditionalGeneration``,
tied head) served on its text model: PEFT names them ``model.language_model.embed_tokens`` and
``lm_head``; the same weights under the older ``language_model.model.embed_tokens`` /
``language_model.lm_head`` naming serve the same. Greedy tokens equal PEFT's, float32."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Gemma3ForConditionalGeneration

from loraplex import LLM, SamplingParams
from loraplex.lora.peft_format import inspect_adapter_dir
from loraplex.model.config import ModelSpec
from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for
from tests.fixtures.tiny_gemma3_mm import make_tiny_gemma3_mm_dir
from tests.lora.test_acceptance import reference

TARGETS = r".*language_model.*\.(q_proj|v_proj|embed_tokens)|(language_model\.)?lm_head"


def to_older_naming(src, dst):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "adapter_model.safetensors"))
    renamed = {
        name.replace("base_model.model.model.language_model.", "base_model.model.language_model.model.")
            .replace("base_model.model.lm_head.", "base_model.model.language_model.lm_head."): t
        for name, t in tensors.items()
    }
    assert any("language_model.lm_head.lora_A" in n for n in renamed)
    save_file(renamed, str(dst / "adapter_model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3-mm-vocab")
    model_dir = make_tiny_gemma3_mm_dir(root / "model", seed=7)
    base = Gemma3ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    dirs = {
        "vocab": make_peft_adapter(base, root / "vocab", seed=41, r=4, lora_alpha=8, target_modules=TARGETS),
        "head": make_peft_adapter(base, root / "head", seed=42, r=2, target_modules=["lm_head"]),
    }
    older = to_older_naming(dirs["vocab"], root / "vocab_older")
    return model_dir, dirs, older, peft_model_for(base, dirs)


def test_targets_read_in_both_namings(world):
    model_dir, dirs, older, _ = world
    spec = ModelSpec.from_dir(model_dir).lora_target_spec()
    for path in (dirs["vocab"], older):
        info = inspect_adapter_dir(path, spec, max_lora_rank=8)
        assert info.targets == ("q_proj", "v_proj", "embed_tokens", "lm_head")
    assert inspect_adapter_dir(dirs["head"], spec, max_lora_rank=8).targets == ("lm_head",)


def test_mixed_batch_matches_peft(world, tmp_path):
    model_dir, dirs, older, peft_model = world
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=tmp_path / "home", max_loras=3,
              max_lora_rank=8, max_num_batched_tokens=64)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 300, (n,), generator=gen).tolist() for n in (7, 30, 12, 20, 9)]
    which = ["vocab", None, "head", "older", "vocab"]
    paths = {"vocab": str(dirs["vocab"]), "head": str(dirs["head"]), "older": str(older)}
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                        adapters=[None if w is None else paths[w] for w in which])
    expected = [reference(peft_model, p, {"older": "vocab"}.get(w, w), 6) for p, w in zip(prompts, which)]
    assert [out.outputs[0].token_ids for out in outs] == expected
    base = [reference(peft_model, p, None, 6) for p in prompts]
    assert all(expected[i] != base[i] for i in (0, 2, 3, 4))
