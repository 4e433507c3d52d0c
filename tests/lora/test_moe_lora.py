"""LoRA on mixture-of-experts base models (Mixtral, Qwen3-MoE, Qwen2-MoE; tiny, random, fp32).

* Attention adapters (one also on embed_tokens and lm_head) made by PEFT on transformers' own MoE
  models: one mixed batch per family (base rows and several adapters), greedy tokens identical to
  PEFT's unmerged model.
* A Qwen3-MoE adapter on the dense MLP of its ``mlp_only_layers`` layer: PEFT 0.21 on
  transformers 5 cannot make one (it turns gate_proj / up_proj / down_proj targets into
  ``target_parameters`` on the experts and leaves the dense layer alone), so it is written by hand
  in PEFT's layout (as transformers 4 + PEFT save it) and checked against transformers' model
  with ``W + scaling * B @ A`` merged in. Its slot stacks exist in that layer only.
* Qwen2-MoE adapters on its shared expert (``mlp.shared_expert.gate_proj`` ...), made by PEFT:
  served as PEFT serves them.
* Adapters on experts, routers or the shared expert's gate, in every form they come in (PEFT's
  ``target_parameters``, per-expert tensors as on the Hub, router tensors, a config entry), are
  refused naming the module: routers always, experts where the engine was started without
  enable_expert_lora (tests/lora/test_moe_expert_lora.py serves them).
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from loraplex import LLM, SamplingParams
from loraplex.lora.errors import InvalidAdapterError
from loraplex.lora.peft_format import load_adapter_files, validate_adapter
from loraplex.lora.records import host_nbytes, max_adapter_host_nbytes
from loraplex.lora.slots import SlotPool
from loraplex.lora.weights import AdapterWeights
from loraplex.model.config import ModelSpec
from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for
from tests.fixtures.tiny_moe import make_tiny_moe_dir
from tests.lora.test_acceptance import greedy, reference

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ADAPTERS = {
    "attn": dict(r=8, lora_alpha=16, target_modules=ATTENTION),
    "qv_layer2": dict(r=4, lora_alpha=6, target_modules=["q_proj", "v_proj"], layers_to_transform=[2]),
    "ko_rslora": dict(r=2, lora_alpha=3, use_rslora=True, target_modules=["k_proj", "o_proj"]),
    "v_vocab": dict(r=4, lora_alpha=8, target_modules=["v_proj", "embed_tokens", "lm_head"]),
}
LAYOUTS = {"mixtral": "fused", "qwen3_moe": "per_expert", "qwen2_moe": "per_expert"}
PROMPTS = [[5 + (7 * i + j) % 250 for j in range(4 + 3 * i)] for i in range(7)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
P = "base_model.model.model.layers."
NEED = (r"LoRA on the experts of a mixture-of-experts model needs an engine started with --enable-expert-lora "
        r"\(enable_expert_lora=True\)")
ROUTER = (r"LoRA on the router of a mixture-of-experts model \(or the shared expert's gate\) is not served, as "
          r"vLLM does not serve it")


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-lora")
    out = {}
    for seed, (family, layout) in enumerate(LAYOUTS.items()):
        model_dir = make_tiny_moe_dir(root / family, family, layout, seed=20 + seed)
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        out[family] = (model_dir, base, ModelSpec.from_dir(model_dir).lora_target_spec())
    return root, out


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_attention_adapters_match_peft(bases, family):
    root, models = bases
    model_dir, base, spec = models[family]
    dirs = {name: make_peft_adapter(base, root / f"{family}-{name}", seed=40 + i, **kw)
            for i, (name, kw) in enumerate(ADAPTERS.items())}
    info = validate_adapter(load_adapter_files(dirs["attn"]), spec, max_lora_rank=8)
    assert info.targets == tuple(ATTENTION) and info.layers == (0, 1, 2)
    peft_model = peft_model_for(base, dirs)
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=root / f"home-{family}", max_loras=2,
              max_lora_rank=8, kv_cache_bytes=4 << 20)
    names = [None, *ADAPTERS]
    which = [names[i % len(names)] for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, GREEDY, adapters=[None if w is None else str(dirs[w]) for w in which])
    expected = [reference(peft_model, prompt, adapter, n=6) for prompt, adapter in zip(PROMPTS, which)]
    assert [out.token_ids for out in outs] == expected
    base_tokens = [reference(peft_model, prompt, None, n=6) for prompt in PROMPTS]
    assert any(e != b for e, b, w in zip(expected, base_tokens, which) if w is not None)  # adapters matter


def test_qwen2_moe_shared_expert_adapters_match_peft(bases):
    """LoRA on Qwen2-MoE's shared expert (``mlp.shared_expert.gate_proj`` ..., a plain SwiGLU scaled
    by its sigmoid gate), with and without attention targets: held in the shared expert's own
    stacks and served as PEFT serves it."""
    root, models = bases
    model_dir, base, spec = models["qwen2_moe"]
    shared = ["shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"]
    dirs = {
        "shared_qv": make_peft_adapter(base, root / "shared-qv", seed=60, r=4, lora_alpha=8,
                                       target_modules=["q_proj", "v_proj", *shared]),
        "shared_down": make_peft_adapter(base, root / "shared-down", seed=61, r=8, lora_alpha=4,
                                         target_modules=["shared_expert.down_proj"]),
    }
    # PEFT keeps these as modules (gate_proj alone it would turn into target_parameters on the experts)
    assert not json.loads((dirs["shared_qv"] / "adapter_config.json").read_text()).get("target_parameters")
    parsed = load_adapter_files(dirs["shared_qv"])
    info = validate_adapter(parsed, spec, max_lora_rank=8)
    assert info.targets == ("q_proj", "v_proj", *shared) and info.layers == (0, 1, 2)
    pool = SlotPool(spec, max_loras=2, max_rank=8, device="cpu", dtype=torch.float32)
    pool.write(1, AdapterWeights.build(parsed, info, spec, torch.float32))
    stack = pool.stacks[2]["shared_expert.gate_up_proj"]
    assert stack.slice_offsets == (0, 48, 96) and "gate_up_proj" not in pool.stacks[2]
    key = f"{P}2.mlp.shared_expert.up_proj.lora_B.weight"
    assert torch.equal(stack.b[1, 48:, :4], parsed.tensors[key])
    peft_model = peft_model_for(base, dirs)
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=root / "home-shared", max_loras=2,
              max_lora_rank=8, kv_cache_bytes=4 << 20)
    which = [None, "shared_qv", "shared_down", "shared_qv", None, "shared_down", "shared_down"]
    outs = llm.generate(PROMPTS, GREEDY, adapters=[None if w is None else str(dirs[w]) for w in which])
    expected = [reference(peft_model, prompt, adapter, n=6) for prompt, adapter in zip(PROMPTS, which)]
    assert [out.token_ids for out in outs] == expected
    base_tokens = [reference(peft_model, prompt, None, n=6) for prompt in PROMPTS]
    for name in dirs:  # each adapter changes some output
        assert any(e != b for e, b, w in zip(expected, base_tokens, which) if w == name), name


def _rewrite(src, dst, target_modules, extra: dict[str, torch.Tensor] | None = None, **config):
    """A copy of adapter ``src`` with ``target_modules`` (and ``config`` keys) in its config and
    ``extra`` tensors added to its weights."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": target_modules, **config}))
    tensors = load_file(dst / "adapter_model.safetensors") | (extra or {})
    save_file(tensors, dst / "adapter_model.safetensors")
    return dst


def test_dense_layer_mlp_adapter_matches_merged_weights(bases):
    """q_proj in every layer (PEFT) plus gate/up/down of layer 1, the dense MLP of the Qwen3-MoE
    (``mlp_only_layers=[1]``), rank 4, alpha 6."""
    root, models = bases
    model_dir, base, spec = models["qwen3_moe"]
    assert spec.module_layers == {"gate_proj": (1,), "up_proj": (1,), "down_proj": (1,)}
    q_only = make_peft_adapter(base, root / "q-only", seed=50, r=4, lora_alpha=6, target_modules=["q_proj"])
    torch.manual_seed(51)
    h, i = 64, 96
    shapes = {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    extra = {}
    for mod, (in_f, out_f) in shapes.items():
        extra[f"{P}1.mlp.{mod}.lora_A.weight"] = torch.randn(4, in_f) * 0.3
        extra[f"{P}1.mlp.{mod}.lora_B.weight"] = torch.randn(out_f, 4) * 0.3
    dense = _rewrite(q_only, root / "dense-mlp", ["q_proj", *shapes], extra)

    parsed = load_adapter_files(dense)
    info = validate_adapter(parsed, spec, max_lora_rank=8)
    assert sorted(info.modules) == sorted([(layer, "q_proj") for layer in range(3)]
                                          + [(1, m) for m in ("down_proj", "gate_proj", "up_proj")])
    weights = AdapterWeights.build(parsed, info, spec, torch.float32)
    assert weights.nbytes == host_nbytes(info, spec, torch.float32)
    # a rank-8 adapter on everything: attention in 3 layers, the MLP in 1
    assert max_adapter_host_nbytes(spec, 8, torch.float32) == 4 * 8 * (
        3 * (2 * (64 + 64) + 2 * (64 + 32)) + (64 + 96) * 3 + 320 * 2 + 64 * 2)
    pool = SlotPool(spec, max_loras=2, max_rank=8, device="cpu", dtype=torch.float32)
    pool.write(0, weights)
    assert [sorted(layer) for layer in pool.stacks] == [["o_proj", "qkv_proj"],
                                                        ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"],
                                                        ["o_proj", "qkv_proj"]]
    # what the engine reserves for the pool (max_adapter_host_nbytes per slot) is what it holds:
    # no MLP stacks in the sparse layers (vocab stacks come with the first vocab adapter)
    assert pool.nbytes == 2 * (max_adapter_host_nbytes(spec, 8, torch.float32) - 4 * 8 * (320 * 2 + 64 * 2))

    merged = copy.deepcopy(base)
    tensors = load_file(dense / "adapter_model.safetensors")
    with torch.no_grad():
        for key in [k for k in tensors if k.endswith("lora_A.weight")]:
            module = key[len("base_model.model."):-len(".lora_A.weight")]
            b = tensors[key.replace("lora_A", "lora_B")]
            merged.get_submodule(module).weight += 6 / 4 * b @ tensors[key]
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=root / "home-dense", max_loras=2,
              max_lora_rank=8, kv_cache_bytes=4 << 20)
    which = [None, "dense", "dense", None, "dense", "dense", "dense"]
    outs = llm.generate(PROMPTS, GREEDY, adapters=[None if w is None else str(dense) for w in which])
    for prompt, adapter, out in zip(PROMPTS, which, outs):
        assert out.token_ids == greedy(base if adapter is None else merged, prompt, 6)
    assert any(greedy(merged, p, 6) != greedy(base, p, 6) for p in PROMPTS)


def _expert_adapters(root, models):
    """(family, adapter dir, the refusal's distinctive part) for each form of expert LoRA."""
    out = []
    base = {f: models[f][1] for f in models}
    # PEFT 0.21 on transformers 5: experts and routers become target_parameters
    peft_experts = make_peft_adapter(base["qwen3_moe"], root / "peft-experts", r=2,
                                     target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])
    assert json.loads((peft_experts / "adapter_config.json").read_text())["target_parameters"]
    out.append(("qwen3_moe", peft_experts, r"target_parameters \[.*'gate_up_proj'.*\(PEFT's LoRA on raw parameters, as "
                r"on fused experts\): " + NEED))
    # per-expert tensors as transformers 4 + PEFT saved them (Hub adapters for Qwen3-30B-A3B, Mixtral)
    q = {f: make_peft_adapter(base[f], root / f"q-{f}", r=2, target_modules=["q_proj"]) for f in models}
    hub_qwen = _rewrite(q["qwen3_moe"], root / "hub-qwen", ["q_proj", "gate_proj"], {
        f"{P}0.mlp.experts.3.gate_proj.lora_A.weight": torch.zeros(2, 64),
        f"{P}0.mlp.experts.3.gate_proj.lora_B.weight": torch.zeros(32, 2)})
    out.append(("qwen3_moe", hub_qwen, r"targets expert module 'model\.layers\.0\.mlp\.experts\.3\.gate_proj': "
                + NEED + r", which holds slot room for it; this one was not \(base model '.*' takes LoRA on q_proj, "
                r"k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, embed_tokens, lm_head\)"))
    hub_mixtral = _rewrite(q["mixtral"], root / "hub-mixtral", ["q_proj", "w1", "w2", "w3"], {
        f"{P}1.block_sparse_moe.experts.0.w2.lora_A.weight": torch.zeros(2, 96),
        f"{P}1.block_sparse_moe.experts.0.w2.lora_B.weight": torch.zeros(64, 2)})
    out.append(("mixtral", hub_mixtral, r"targets expert module 'model\.layers\.1\.block_sparse_moe\.experts\.0\.w2': "
                + NEED + r".*\(base model '.*' takes LoRA on q_proj, k_proj, v_proj, o_proj, embed_tokens, lm_head\)"))
    router = _rewrite(q["mixtral"], root / "router", ["q_proj", "gate"], {
        f"{P}0.block_sparse_moe.gate.lora_A.weight": torch.zeros(2, 64),
        f"{P}0.block_sparse_moe.gate.lora_B.weight": torch.zeros(6, 2)})
    out.append(("mixtral", router, r"targets 'model\.layers\.0\.block_sparse_moe\.gate', a mixture-of-experts .*: "
                + ROUTER))
    # PEFT's all-linear on Qwen2-MoE takes the shared expert (served) and its gate (refused)
    shared = make_peft_adapter(base["qwen2_moe"], root / "shared", r=2, target_modules="all-linear")
    out.append(("qwen2_moe", shared, r"targets 'model\.layers\.0\.mlp\.shared_expert_gate', a mixture-of-.*: " + ROUTER))
    # the config names expert modules its tensors leave out
    named = _rewrite(q["mixtral"], root / "named-w1", ["q_proj", "w1"])
    out.append(("mixtral", named, r"target_modules entry 'w1' names a mixture-of-experts module .*: " + NEED))
    # a dense-MLP tensor on a layer whose MLP is sparse
    sparse_layer = _rewrite(q["qwen3_moe"], root / "sparse-layer", ["q_proj", "down_proj"], {
        f"{P}2.mlp.down_proj.lora_A.weight": torch.zeros(2, 96),
        f"{P}2.mlp.down_proj.lora_B.weight": torch.zeros(64, 2)})
    out.append(("qwen3_moe", sparse_layer, r"targets 'down_proj' in layer 2, whose MLP is a sparse block of experts "
                r"\(a dense down_proj is in layers \[1\] only\): " + NEED))
    return out


def test_expert_adapters_are_refused(bases):
    root, models = bases
    for family, adapter_dir, message in _expert_adapters(root, models):
        spec = models[family][2]
        with pytest.raises(InvalidAdapterError, match=message):
            validate_adapter(load_adapter_files(adapter_dir), spec, max_lora_rank=8)


def test_expert_adapter_is_refused_by_the_engine(bases):
    """Through ``LLM.generate``: the request fails with the refusal, the base model still serves."""
    root, models = bases
    model_dir, base, _ = models["mixtral"]
    _, adapter_dir, message = _expert_adapters(root / "engine", models)[2]
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=root / "home-refuse", max_loras=2,
              max_lora_rank=8, kv_cache_bytes=4 << 20)
    with pytest.raises(InvalidAdapterError, match=message):
        llm.generate([PROMPTS[0]], GREEDY, adapters=[str(adapter_dir)])
    assert llm.generate([PROMPTS[1]], GREEDY)[0].token_ids == greedy(base, PROMPTS[1], 6)
