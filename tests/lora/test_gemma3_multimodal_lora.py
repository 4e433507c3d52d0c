"""PEFT adapters trained on a multimodal Gemma 3 (``Gemma3ForConditionalGeneration``), served on
its text model: greedy outputs of a batch mixing the base model and adapters equal PEFT's own
model on transformers' multimodal Gemma 3 (text-only, float32), for an adapter on the language
model's projections, one made with ``target_modules="all-linear"`` (which also puts LoRA on the
vision tower: ignored, with a warning), one with a plain module list, and one whose tensors use
the older ``language_model.model.*`` naming."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Gemma3ForConditionalGeneration

from loraplex import LLM, SamplingParams
from loraplex.lora.errors import InvalidAdapterError
from loraplex.lora.peft_format import inspect_adapter_dir
from loraplex.model.config import ModelSpec
from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for
from tests.fixtures.tiny_gemma3_mm import make_tiny_gemma3_mm_dir
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.lora.test_acceptance import reference

LANGUAGE_ONLY = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
VISION = re.compile(r"^base_model\.model\.(model\.)?(vision_tower|multi_modal_projector)\.")


def to_older_naming(src, dst):
    """A copy of a PEFT adapter whose tensors name modules as transformers < 4.52 did:
    ``language_model.model.layers...`` and ``vision_tower...`` under ``base_model.model.``."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "adapter_model.safetensors"))
    renamed = {
        name.replace("base_model.model.model.language_model.", "base_model.model.language_model.model.")
            .replace("base_model.model.model.vision_tower.", "base_model.model.vision_tower."): t
        for name, t in tensors.items()
    }
    assert renamed.keys() != tensors.keys()
    save_file(renamed, str(dst / "adapter_model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3-mm-lora")
    model_dir = make_tiny_gemma3_mm_dir(root / "model", seed=7)
    base = Gemma3ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    dirs = {
        "language": make_peft_adapter(base, root / "language", seed=31, r=8, lora_alpha=16,
                                      target_modules=LANGUAGE_ONLY),
        "all_linear": make_peft_adapter(base, root / "all_linear", seed=32, r=4, target_modules="all-linear"),
        "qv_list": make_peft_adapter(base, root / "qv", seed=33, r=2, lora_alpha=3, use_rslora=True,
                                     target_modules=["q_proj", "v_proj"]),
    }
    older = to_older_naming(dirs["language"], root / "language_older")
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=root / "home", max_loras=3, max_lora_rank=8,
              max_num_batched_tokens=64)  # long prompts are chunked
    return llm, dirs, older, peft_model_for(base, dirs), model_dir


def test_adapters_on_the_vision_tower_are_real_and_reported(world):
    """all-linear and the q/v list put non-zero LoRA on vision modules; the language-only one
    does not. Validation keeps the language model's modules and warns about the rest."""
    llm, dirs, older, _, model_dir = world
    spec = ModelSpec.from_dir(model_dir).lora_target_spec()
    for name, path in {**dirs, "language_older": older}.items():
        tensors = load_file(str(path / "adapter_model.safetensors"))
        vision = {n: t for n, t in tensors.items() if VISION.match(n)}
        info = inspect_adapter_dir(path, spec, max_lora_rank=8)
        language_modules = (len(tensors) - len(vision)) // 2
        assert len(info.modules) == language_modules > 0
        if name.startswith("language"):
            assert not vision and info.warnings == ()
        else:
            assert vision and all(t.abs().sum() > 0 for t in vision.values())
            assert len(info.warnings) == 1 and f"{len(vision) // 2} modules" in info.warnings[0]
    all_linear = json.loads((dirs["all_linear"] / "adapter_config.json").read_text())["target_modules"]
    assert {"fc1", "fc2", "out_proj"} <= set(all_linear)  # vision-only names PEFT saved in the config


def test_mixed_batch_matches_peft(world):
    llm, dirs, older, peft_model, _ = world
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(4, 300, (n,), generator=gen).tolist() for n in (6, 30, 11, 45, 20, 8, 70, 3, 25)]
    which = [None, "language", "all_linear", "qv_list", "language", "all_linear", "qv_list", None, "older"]
    paths = {**{name: str(path) for name, path in dirs.items()}, "older": str(older)}
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        adapters=[None if w is None else paths[w] for w in which])
    # the older naming holds the language adapter's weights: PEFT's "language" is its reference
    expected = [reference(peft_model, p, {"older": "language"}.get(w, w)) for p, w in zip(prompts, which)]
    assert [out.token_ids for out in outs] == expected
    base = {i: reference(peft_model, prompts[i], None) for i in range(len(prompts))}
    for name in [*dirs, "older"]:  # each adapter changes the greedy tokens of some prompt it serves
        assert any(expected[i] != base[i] for i in range(len(prompts)) if which[i] == name), name


def _write_adapter(src, dst, keep):
    """A copy of ``src`` holding only the tensors ``keep(name)`` accepts."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "adapter_model.safetensors"))
    save_file({n: t for n, t in tensors.items() if keep(n)}, str(dst / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    return dst


def test_vision_only_adapter_is_refused(world, tmp_path):
    _, dirs, _, _, model_dir = world
    spec = ModelSpec.from_dir(model_dir).lora_target_spec()
    path = _write_adapter(dirs["all_linear"], tmp_path / "vision_only", lambda n: VISION.match(n) is not None)
    with pytest.raises(InvalidAdapterError, match="only on modules .* does not run"):
        inspect_adapter_dir(path, spec, max_lora_rank=8)


def test_malformed_vision_tensor_is_refused(world, tmp_path):
    _, dirs, _, _, model_dir = world
    spec = ModelSpec.from_dir(model_dir).lora_target_spec()
    path = tmp_path / "bad"
    shutil.copytree(dirs["all_linear"], path)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    tensors["base_model.model.model.vision_tower.encoder.layers.0.mlp.fc1.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InvalidAdapterError, match="only lora_A.weight / lora_B.weight"):
        inspect_adapter_dir(path, spec, max_lora_rank=8)


def test_text_only_base_refuses_vision_lora(world, tmp_path):
    """On a Gemma3ForCausalLM base there is no vision tower to ignore: such tensors are an error."""
    _, dirs, _, _, _ = world
    text_dir = make_tiny_model_dir(tmp_path / "text", "gemma3", seed=7)
    spec = ModelSpec.from_dir(text_dir).lora_target_spec()
    with pytest.raises(InvalidAdapterError):
        inspect_adapter_dir(dirs["all_linear"], spec, max_lora_rank=8)
