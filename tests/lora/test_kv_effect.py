"""``AdapterInfo.changes_kv`` (lora/kv_effect.py) against the K/V that PEFT's own model computes:
for each adapter, the outputs of every layer's ``k_proj`` and ``v_proj`` (LoRA included) on a
prompt, with the adapter and without. An adapter said not to change K/V must leave them equal
bit for bit (its requests then share the base model's prefix-cache blocks); every adapter said
to change them does. On Llama, Gemma 2 (windowed and global layers, sandwich norms) and
Qwen2-MoE (expert and shared-expert LoRA)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex.lora.peft_format import load_adapter_files, validate_adapter
from loraplex.model.config import ModelSpec
from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.fixtures.tiny_moe import make_tiny_moe_dir

AFTER_KV = ["o_proj", "gate_proj", "up_proj", "down_proj"]


def _adapters(last: int, moe: bool, shared_expert: bool = True) -> dict[str, tuple[dict, bool]]:
    """name -> (PEFT LoraConfig arguments, whether the rule says the K/V change)."""
    out = {
        "head": (dict(target_modules=["lm_head"]), False),
        "last_after_kv": (dict(target_modules=AFTER_KV, layers_to_transform=[last]), False),
        "head_and_last": (dict(target_modules=["lm_head", "o_proj", "down_proj"], layers_to_transform=[last]), False),
        "last_kv": (dict(target_modules=["k_proj", "v_proj"], layers_to_transform=[last]), True),
        "earlier_o": (dict(target_modules=["o_proj"], layers_to_transform=[last - 1]), True),
        "qkv": (dict(target_modules=["q_proj", "k_proj", "v_proj"]), True),
        "embed": (dict(target_modules=["embed_tokens"]), True),
        # the last layer's q does not reach any K/V, but it is kept on the safe side (module doc)
        "last_q": (dict(target_modules=["q_proj"], layers_to_transform=[last]), True),
    }
    if moe:
        experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        shared = ["shared_expert.gate_proj", "shared_expert.down_proj"] if shared_expert else []
        last_experts = [f"layers.{last}.{p}" for p in experts]
        if shared_expert:
            out["last_experts"] = (dict(target_modules=rf".*layers\.{last}\.(self_attn\.o_proj|mlp\.shared_expert\.(gate|up|down)_proj)",
                                        target_parameters=last_experts), False)
        else:  # PEFT turns a regex target_modules on Mixtral into its module names, on every layer
            out["last_experts"] = (dict(target_modules=["o_proj"], layers_to_transform=[last],
                                        target_parameters=last_experts), False)
        out["experts"] = (dict(target_modules=["o_proj", *shared], target_parameters=experts), True)
    return out


def _kv(model, prompt: list[int]) -> list[torch.Tensor]:
    """Every layer's k_proj and v_proj outputs (PEFT's LoRA wrapper included) on ``prompt``."""
    outs: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: outs.append(out.detach().clone()))
             for name, m in model.named_modules() if name.endswith(("self_attn.k_proj", "self_attn.v_proj"))]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([prompt]))
    finally:
        for h in hooks:
            h.remove()
    return outs


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen2_moe", "mixtral"])
def test_changes_kv_agrees_with_peft_s_k_and_v(family, tmp_path):
    moe = family in ("qwen2_moe", "mixtral")
    model_dir = (make_tiny_moe_dir(tmp_path / "base", family, "per_expert", seed=31) if moe
                 else make_tiny_model_dir(tmp_path / "base", family, seed=5))
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()
    last = base.config.num_hidden_layers - 1
    cases = _adapters(last, moe, shared_expert=family == "qwen2_moe")
    if family == "mixtral":  # every MLP is experts: no dense gate/up/down to target
        dense = {"gate_proj", "up_proj", "down_proj"}
        cases = {name: ({**kw, "target_modules": [m for m in kw["target_modules"] if m not in dense]}
                        if isinstance(kw["target_modules"], list) else kw, rule)
                 for name, (kw, rule) in cases.items()}
    dirs = {name: make_peft_adapter(base, tmp_path / name, seed=60 + i, r=4, **kw)
            for i, (name, (kw, _)) in enumerate(cases.items())}
    spec = ModelSpec.from_dir(model_dir).lora_target_spec(expert_lora=moe)
    prompt = torch.randint(4, 90, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    base_kv = _kv(base, prompt)
    assert len(base_kv) == 2 * (last + 1)
    for name, (_, rule) in cases.items():
        info = validate_adapter(load_adapter_files(dirs[name]), spec, max_lora_rank=4)
        assert info.changes_kv is rule, name
        assert bool(info.expert_modules) == (name in ("last_experts", "experts")), name
        # one PeftModel each: PEFT refuses adapters with different target_parameters side by side
        peft_model = peft_model_for(base, {name: dirs[name]})
        kv = _kv(peft_model, prompt)
        same = all(torch.equal(a, b) for a, b in zip(kv, base_kv))
        if not info.changes_kv:
            assert same, name  # the promise the prefix cache relies on
        elif name != "last_q":
            assert not same, name  # the rule says so for a reason
        # and the adapter does something: its logits differ from the base model's
        with torch.no_grad():
            logits = peft_model(input_ids=torch.tensor([prompt])).logits
            plain = base(input_ids=torch.tensor([prompt])).logits
        assert not torch.equal(logits, plain), name


def test_lm_head_lora_on_a_tied_model(tmp_path):
    """Tied embeddings: a LoRA on lm_head alone leaves PEFT's K/V as the base's (it shares the
    base's blocks), but the same tensors with ``ensure_weight_tying`` in the config (as hand
    edited: PEFT itself then saves embed_tokens in target_modules, with its tensors) make PEFT
    put that LoRA on the embedding too, so every K/V changes: such an adapter is refused, not
    served as a base-K/V sharer with lm_head alone."""
    import json
    import shutil

    from loraplex.lora.errors import InvalidAdapterError

    model_dir = make_tiny_model_dir(tmp_path / "base", "tied", seed=3)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()
    spec = ModelSpec.from_dir(model_dir).lora_target_spec()
    assert spec.tied_embeddings
    head = make_peft_adapter(base, tmp_path / "head", seed=8, r=4, target_modules=["lm_head"])
    prompt = torch.randint(4, 90, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    base_kv = _kv(base, prompt)

    info = validate_adapter(load_adapter_files(head), spec, max_lora_rank=4)
    assert info.changes_kv is False
    assert all(torch.equal(a, b) for a, b in zip(_kv(peft_model_for(base, {"head": head}), prompt), base_kv))

    edited = tmp_path / "edited"
    shutil.copytree(head, edited)
    config = json.loads((edited / "adapter_config.json").read_text())
    (edited / "adapter_config.json").write_text(json.dumps({**config, "ensure_weight_tying": True}))
    kv = _kv(peft_model_for(base, {"edited": edited}), prompt)
    assert not all(torch.equal(a, b) for a, b in zip(kv, base_kv))  # PEFT: the embedding took the LoRA
    with pytest.raises(InvalidAdapterError, match="ensure_weight_tying"):
        validate_adapter(load_adapter_files(edited), spec, max_lora_rank=4)


def _outputs_of(model, prompt: list[int], suffixes: tuple[str, ...]) -> list[torch.Tensor]:
    outs: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: outs.append(out.detach().clone()))
             for name, m in model.named_modules() if name.endswith(suffixes)]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([prompt]))
    finally:
        for h in hooks:
            h.remove()
    return outs


def test_phi3_fused_modules(tmp_path):
    """Phi-3's fused modules: the last layer's ``gate_up_proj`` (and ``o_proj``) come after its
    K/V write and share the base's blocks; its fused ``qkv_proj`` writes them. Checked against
    every layer's ``qkv_proj`` output in PEFT (K and V are slices of it; q alone never changes
    here, so a change there is a K/V change)."""
    from tests.fixtures.tiny_phi3 import make_tiny_phi3_dir

    model_dir = make_tiny_phi3_dir(tmp_path / "base", seed=4)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()
    last = base.config.num_hidden_layers - 1
    cases = {
        "last_after_kv": (dict(target_modules=["o_proj", "gate_up_proj", "down_proj"], layers_to_transform=[last]), False),
        "head_and_last": (dict(target_modules=["lm_head", "gate_up_proj"], layers_to_transform=[last]), False),
        "last_qkv": (dict(target_modules=["qkv_proj"], layers_to_transform=[last]), True),
        "earlier_gate_up": (dict(target_modules=["gate_up_proj"], layers_to_transform=[last - 1]), True),
    }
    spec = ModelSpec.from_dir(model_dir).lora_target_spec()
    prompt = torch.randint(4, 90, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    base_qkv = _outputs_of(base, prompt, ("self_attn.qkv_proj",))
    assert len(base_qkv) == last + 1
    for i, (name, (kw, rule)) in enumerate(cases.items()):
        d = make_peft_adapter(base, tmp_path / name, seed=70 + i, r=4, **kw)
        info = validate_adapter(load_adapter_files(d), spec, max_lora_rank=4)
        assert info.changes_kv is rule, name
        peft_model = peft_model_for(base, {name: d})
        same = all(torch.equal(a, b) for a, b in zip(_outputs_of(peft_model, prompt, ("self_attn.qkv_proj",)), base_qkv))
        assert same is not rule, name


def test_a_merge_is_judged_on_its_own_modules(tmp_path):
    """A merge is written as PEFT files and validated again: two last-layer adapters after the
    K/V write merge into one that keeps K/V (PEFT's k/v equal the base's), and a merge with an
    attention adapter into one that changes them."""
    from loraplex.lora.merge import MergeParams, merge_adapters, write_adapter_dir

    model_dir = make_tiny_model_dir(tmp_path / "base", "llama", seed=6)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()
    last = base.config.num_hidden_layers - 1
    spec = ModelSpec.from_dir(model_dir).lora_target_spec()
    kinds = {"o": dict(target_modules=["o_proj"], layers_to_transform=[last]),
             "mlp": dict(target_modules=["down_proj", "up_proj"], layers_to_transform=[last]),
             "kv": dict(target_modules=["k_proj", "v_proj"], layers_to_transform=[last])}
    parts = {}
    for i, (name, kw) in enumerate(kinds.items()):
        parsed = load_adapter_files(make_peft_adapter(base, tmp_path / name, seed=80 + i, r=4, **kw))
        parts[name] = (parsed, validate_adapter(parsed, spec, max_lora_rank=4))
    prompt = torch.randint(4, 90, (10,), generator=torch.Generator().manual_seed(4)).tolist()
    base_kv = _kv(base, prompt)
    for names, rule in ((("o", "mlp"), False), (("o", "kv"), True)):
        merged = merge_adapters([parts[n] for n in names], MergeParams("linear", (0.7, 0.6)), seed=3)
        d = write_adapter_dir(merged, tmp_path / "+".join(names))
        info = validate_adapter(load_adapter_files(d), spec, max_lora_rank=4)
        assert info.changes_kv is rule, names
        same = all(torch.equal(a, b) for a, b in zip(_kv(peft_model_for(base, {"m": d}), prompt), base_kv))
        assert same is not rule, names


def test_untied_vocab_loras_with_ensure_weight_tying_are_refused(tmp_path):
    """Tied embeddings, LoRAs on embed_tokens and lm_head trained apart (not each other's
    transpose) and ``ensure_weight_tying`` added to the config by hand: PEFT ties the two when
    it loads the adapter, so the saved lm_head LoRA overwrites the embedding's, and its tokens
    differ from serving the two as saved. Refused, naming the flag; the same file without the
    flag is served as saved, and PEFT's own tied save is accepted."""
    import json
    import shutil

    from loraplex.lora.errors import InvalidAdapterError

    model_dir = make_tiny_model_dir(tmp_path / "base", "tied", seed=3)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()
    spec = ModelSpec.from_dir(model_dir).lora_target_spec()
    apart = make_peft_adapter(base, tmp_path / "apart", seed=8, r=4, target_modules=["embed_tokens", "lm_head"])
    edited = tmp_path / "edited"
    shutil.copytree(apart, edited)
    config = json.loads((edited / "adapter_config.json").read_text())
    (edited / "adapter_config.json").write_text(json.dumps({**config, "ensure_weight_tying": True}))

    # the reference: PEFT's loaded embedding LoRA is not the one saved, but lm_head's transposed
    from safetensors.torch import load_file
    saved = load_file(str(edited / "adapter_model.safetensors"))
    model = peft_model_for(base, {"edited": edited})
    embedding = next(m for n, m in model.named_modules() if n.endswith("embed_tokens") and hasattr(m, "lora_embedding_A"))
    loaded_a = embedding.lora_embedding_A["edited"].detach()
    assert not torch.equal(loaded_a, saved["base_model.model.model.embed_tokens.lora_embedding_A"])
    assert torch.equal(loaded_a, saved["base_model.model.lm_head.lora_B.weight"].T)

    with pytest.raises(InvalidAdapterError, match="ensure_weight_tying is set .* not the embedding's transposed"):
        validate_adapter(load_adapter_files(edited), spec, max_lora_rank=4)
    assert validate_adapter(load_adapter_files(apart), spec, max_lora_rank=4).vocab_modules.keys() == {
        "embed_tokens", "lm_head"}
    tied = make_peft_adapter(base, tmp_path / "tied", seed=9, r=4, target_modules=["embed_tokens", "lm_head"],
                             ensure_weight_tying=True)
    assert validate_adapter(load_adapter_files(tied), spec, max_lora_rank=4).vocab_modules.keys() == {
        "embed_tokens", "lm_head"}
