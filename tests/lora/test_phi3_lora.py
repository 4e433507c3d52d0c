"""PEFT adapters trained on Phi-3, which target its fused modules (``qkv_proj``, ``o_proj``,
``gate_up_proj``, ``down_proj``): validated against the Phi-3 base (shapes, targets, refusals),
held in the slot exactly as in the file, and served in one mixed batch with several ranks and
target subsets, greedy tokens identical to PEFT's own unmerged model and to transformers'
``generate`` on the PEFT-merged weights (float32). The base has GQA (q 64, k 32, v 32), so the
fused B is not three equal thirds, and partial rotary (Phi-4-mini's 0.75)."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex import LLM, SamplingParams
from loraplex.lora.errors import InvalidAdapterError
from loraplex.lora.peft_format import load_adapter_files, validate_adapter
from loraplex.lora.records import host_nbytes
from loraplex.lora.slots import SlotPool
from loraplex.lora.weights import AdapterWeights
from loraplex.model.config import ModelSpec
from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for, tiny_llama
from tests.fixtures.tiny_phi3 import make_tiny_phi3_dir
from tests.lora.test_acceptance import reference

FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
ADAPTERS = {
    "fused_all": dict(r=8, lora_alpha=16, target_modules=FUSED),
    "qkv": dict(r=4, lora_alpha=8, target_modules=["qkv_proj"]),
    "mlp_patterns": dict(
        r=2, lora_alpha=3, target_modules=["gate_up_proj", "down_proj"],
        rank_pattern={"down_proj": 6}, alpha_pattern={"gate_up_proj": 5},
    ),
    "rslora_layer1": dict(r=6, lora_alpha=4, use_rslora=True, target_modules=["qkv_proj", "down_proj"],
                          layers_to_transform=[1]),
    "all_linear": dict(r=3, lora_alpha=7, target_modules="all-linear"),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("phi3-lora")
    model_dir = make_tiny_phi3_dir(root / "model", seed=7, partial_rotary_factor=0.75)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    assert type(base).__name__ == "Phi3ForCausalLM"
    dirs = {name: make_peft_adapter(base, root / name, seed=30 + i, **kw)
            for i, (name, kw) in enumerate(ADAPTERS.items())}
    spec = ModelSpec.from_dir(model_dir).lora_target_spec()
    return model_dir, base, dirs, spec, root


def test_fused_adapter_validates_and_fills_its_slot_as_stored(world):
    _, _, dirs, spec, _ = world
    parsed = load_adapter_files(dirs["fused_all"])
    info = validate_adapter(parsed, spec, max_lora_rank=8)
    assert info.targets == tuple(FUSED)
    weights = AdapterWeights.build(parsed, info, spec, torch.float32)
    assert weights.nbytes == host_nbytes(info, spec, torch.float32)  # what the host cache budgets
    pool = SlotPool(spec, max_loras=2, max_rank=8, device="cpu", dtype=torch.float32)
    pool.write(1, weights)
    stack = pool.stacks[1]["qkv_proj"]
    assert stack.a.shape == (1, 2, 8, 64) and stack.b.shape == (2, 128, 8) and stack.slice_offsets == (0, 128)
    prefix = "base_model.model.model.layers.1.self_attn.qkv_proj"
    assert torch.equal(stack.a[0, 1], parsed.tensors[f"{prefix}.lora_A.weight"])  # [r, hidden]
    assert torch.equal(stack.b[1], parsed.tensors[f"{prefix}.lora_B.weight"])  # [q + k + v, r]
    assert stack.scaling[0, 1].item() == 2.0 and int(stack.rank[1]) == 8
    mlp = validate_adapter(load_adapter_files(dirs["mlp_patterns"]), spec, max_lora_rank=8)
    assert {(m.module, m.rank, m.scaling) for m in mlp.modules.values()} == {
        ("gate_up_proj", 2, 2.5), ("down_proj", 6, 0.5)}


def test_adapters_that_do_not_fit_phi3_are_refused(world, tmp_path):
    _, _, _, spec, _ = world
    # trained on a Llama of the same width: q_proj etc. do not exist in Phi-3
    llama_adapter = make_peft_adapter(tiny_llama(seed=1), tmp_path / "llama", r=4, target_modules=["q_proj", "v_proj"])
    with pytest.raises(InvalidAdapterError, match=r"targets 'q_proj', which base model 'model' lacks "
                       r"\(its LoRA targets are qkv_proj, o_proj, gate_up_proj, down_proj, embed_tokens, lm_head\)"):
        validate_adapter(load_adapter_files(llama_adapter), spec, max_lora_rank=8)
    # a config naming a Llama module beside the fused ones it has tensors for: the refusal names
    # this base's own targets in a readable sentence
    listed = tmp_path / "listed"
    shutil.copytree(world[2]["qkv"], listed)
    config = json.loads((listed / "adapter_config.json").read_text())
    (listed / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["qkv_proj", "q_proj"]}))
    with pytest.raises(InvalidAdapterError, match=r"entry 'q_proj' is not a module the base model has as a LoRA "
                       r"target \(its LoRA targets are qkv_proj, o_proj, gate_up_proj, down_proj, "
                       r"embed_tokens, lm_head\)"):
        validate_adapter(load_adapter_files(listed), spec, max_lora_rank=8)
    # trained on a Phi-3 without GQA: its fused qkv_proj B has 192 rows, this base's 128
    mha = AutoModelForCausalLM.from_pretrained(
        str(make_tiny_phi3_dir(tmp_path / "mha", num_key_value_heads=4)), dtype=torch.float32)
    mha_adapter = make_peft_adapter(mha, tmp_path / "mha-adapter", r=4, target_modules=["qkv_proj"])
    with pytest.raises(InvalidAdapterError,
                       match=r"qkv_proj.lora_B.weight' has shape \[192, 4\], base model needs \[128, 4\]"):
        validate_adapter(load_adapter_files(mha_adapter), spec, max_lora_rank=8)
    # and the other way: a fused adapter on a Llama base
    llama_spec = ModelSpec.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 64,
                                      "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                                      "num_key_value_heads": 2}).lora_target_spec()
    with pytest.raises(InvalidAdapterError, match="targets 'qkv_proj', which base model 'model' lacks"):
        validate_adapter(load_adapter_files(world[2]["qkv"]), llama_spec, max_lora_rank=8)


@pytest.mark.slow  # ~18 s on a 2-core machine
def test_mixed_batch_matches_peft_unmerged_and_merged(world):
    model_dir, base, dirs, _, root = world
    peft_model = peft_model_for(base, dirs)
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=root / "home", max_loras=2, max_lora_rank=8)
    names = [None, *ADAPTERS]
    prompts = [[5 + (7 * i + j) % 250 for j in range(5 + 2 * i)] for i in range(8)]
    which = [names[i % len(names)] for i in range(len(prompts))]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        adapters=[None if w is None else str(dirs[w]) for w in which])
    expected = [reference(peft_model, prompt, adapter) for prompt, adapter in zip(prompts, which)]
    assert [out.token_ids for out in outs] == expected
    base_tokens = [reference(peft_model, prompt, None) for prompt in prompts]
    for name in ADAPTERS:  # each adapter changes the greedy tokens of a prompt it served
        assert any(expected[i] != base_tokens[i] for i, adapter in enumerate(which) if adapter == name), name

    from peft import PeftModel

    merged = PeftModel.from_pretrained(copy.deepcopy(base), str(dirs["fused_all"])).merge_and_unload().eval()
    for prompt, adapter, out in zip(prompts, which, outs):
        if adapter == "fused_all":
            with torch.no_grad():
                generated = merged.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8,
                                            do_sample=False, pad_token_id=2)
            assert out.token_ids == generated[0, len(prompt):].tolist()
