"""LoRA on the experts of mixture-of-experts models (Mixtral, Qwen3-MoE, Qwen2-MoE; tiny, random, fp32,
CPU), on an engine with ``enable_expert_lora``:

* PEFT 0.21 on transformers 5 (``target_parameters`` on the fused ``mlp.experts.gate_up_proj`` /
  ``down_proj``, PEFT's own saved files): logits of a mixed batch (a base-only sequence, an
  attention-only adapter, expert adapters with a ``rank_pattern`` and with rsLoRA, Qwen2-MoE's
  with its shared expert too) equal PEFT's unmerged model's, prefill then decode steps.
* The per-expert layout of published adapters (``mlp.experts.{e}.gate_proj`` ...,
  ``block_sparse_moe.experts.{e}.w1`` ..., a subset of the experts): greedy tokens equal those of
  transformers' model with ``W + scaling * B @ A`` merged into each expert by the test, loaded as a
  plain checkpoint.
* Slot memory: what the engine reserves per slot is what the pool holds.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from loraplex import LLM, SamplingParams
from loraplex.config import EngineConfig
from loraplex.lora.manager import LoRAManager
from loraplex.lora.peft_format import load_adapter_files, validate_adapter
from loraplex.lora.records import host_nbytes, max_adapter_host_nbytes
from loraplex.lora.slots import SlotPool
from loraplex.lora.weights import AdapterWeights
from loraplex.model.config import ModelSpec
from loraplex.model.loader import load_model
from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for
from tests.engine.test_lora_slot_reserve import held_tensor_bytes
from tests.fixtures.tiny_moe import make_tiny_moe_dir
from tests.lora.test_acceptance import greedy
from tests.model.helpers import chunk_metadata, new_kv_caches, relative_error

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
BLOCK = 16


def _adapters(family: str) -> dict[str, dict]:
    shared = ["shared_expert.gate_proj", "shared_expert.down_proj"] if family == "qwen2_moe" else []
    return {
        "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        "experts": dict(r=4, lora_alpha=6, target_modules=["k_proj", *shared], target_parameters=EXPERTS,
                        rank_pattern={"layers.2.mlp.experts.down_proj": 2}),
        "experts_rs": dict(r=2, lora_alpha=3, use_rslora=True, target_modules=["o_proj"],
                           target_parameters=EXPERTS),
    }


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_fused_expert_adapters_logits_match_peft(tmp_path, family):
    model_dir = make_tiny_moe_dir(tmp_path / "base", family, "per_expert", seed=31)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    dirs = {name: make_peft_adapter(base, tmp_path / name, seed=70 + i, **kw)
            for i, (name, kw) in enumerate(_adapters(family).items())}
    assert json.loads((dirs["experts"] / "adapter_config.json").read_text())["target_parameters"]
    peft_model = peft_model_for(base, dirs)
    spec = ModelSpec.from_dir(model_dir)
    config = EngineConfig(max_loras=3, max_lora_rank=4, enable_expert_lora=True)
    manager = LoRAManager(spec.lora_target_spec(expert_lora=True), config, "cpu", torch.float32)
    ids = {name: manager.resolve(str(path)) for name, path in dirs.items()}
    info = validate_adapter(load_adapter_files(dirs["experts"]), manager.spec, max_lora_rank=4)
    assert info.targets[-3:] == ("experts.gate_proj", "experts.up_proj", "experts.down_proj")
    assert info.expert_modules[(2, "down", -1)].rank == 2 and info.expert_modules[(2, "gate_up", -1)].rank == 4
    model = load_model(model_dir, spec, torch.float32, "cpu", max_positions=256)

    torch.manual_seed(5)
    which = [None, "attn", "experts", "experts_rs", "experts"]
    seqs = [torch.randint(0, spec.vocab_size, (n,)).tolist() for n in (12, 9, 14, 7, 10)]
    prompt_lens = [8, 5, 11, 4, 6]
    tables = [[2 * i, 2 * i + 1] for i in range(len(seqs))]
    expected = []
    for seq, name in zip(seqs, which):
        with torch.no_grad():
            if name is None:
                with peft_model.disable_adapter():
                    expected.append(peft_model(torch.tensor([seq])).logits[0].float())
            else:
                peft_model.set_adapter(name)
                expected.append(peft_model(torch.tensor([seq])).logits[0].float())
    kv = new_kv_caches(spec, 2 * len(seqs), BLOCK)
    token_adapters = [None if w is None else ids[w] for w, n in zip(which, prompt_lens) for _ in range(n)]
    positions, attn = chunk_metadata([(0, n, t) for n, t in zip(prompt_lens, tables)], BLOCK)
    tokens = torch.tensor([tok for seq, n in zip(seqs, prompt_lens) for tok in seq[:n]])
    ctx = manager.prepare_step(token_adapters)
    with torch.no_grad():
        logits = model.compute_logits(model(tokens, positions, attn, kv, lora=ctx))
    want = torch.cat([e[:n] for e, n in zip(expected, prompt_lens)])
    assert relative_error(logits, want) < 1e-4
    for step in range(3):  # decode steps: one token per sequence
        positions, attn = chunk_metadata([(n + step, 1, t) for n, t in zip(prompt_lens, tables)], BLOCK)
        tokens = torch.tensor([seq[n + step] for seq, n in zip(seqs, prompt_lens)])
        ctx = manager.prepare_step([None if w is None else ids[w] for w in which])
        with torch.no_grad():
            logits = model.compute_logits(model(tokens, positions, attn, kv, lora=ctx))
        want = torch.stack([e[n + step] for e, n in zip(expected, prompt_lens)])
        assert relative_error(logits, want) < 1e-4, f"decode step {step}"
    with torch.no_grad(), peft_model.disable_adapter():
        plain = peft_model(torch.tensor([seqs[2]])).logits[0]
    assert relative_error(expected[2], plain) > 1e-2  # the expert adapter matters


def _per_expert_adapter(tmp_path, family: str, spec) -> tuple:
    """A transformers-4-style per-expert adapter written by hand: q_proj in every layer, gate / up /
    down of some experts (expert 0 left out; expert 3's gate at rank 1 via rank_pattern), and the
    base model with those deltas merged (``W + alpha / r * B @ A``) by the test itself."""
    experts = spec.lora_target_spec(expert_lora=True).experts
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    names = experts.part_names
    gen = torch.Generator().manual_seed(8)
    tensors, merged_deltas = {}, {}
    h, i = experts.hidden, experts.inter
    for layer in experts.layers:
        for e in range(1, experts.num_experts):
            for part, name in names.items():
                rank = 1 if (e == 3 and part == "gate") else 4
                in_f, out_f = (i, h) if part == "down" else (h, i)
                key = f"model.layers.{layer}.{block}.experts.{e}.{name}"
                a, b = torch.randn(rank, in_f, generator=gen) * 0.3, torch.randn(out_f, rank, generator=gen) * 0.3
                tensors[f"base_model.model.{key}.lora_A.weight"] = a
                tensors[f"base_model.model.{key}.lora_B.weight"] = b
                merged_deltas[key] = (8 / rank) * b @ a
    for layer in (layer for layer in range(spec.num_layers) if layer not in experts.layers):
        for part, name in names.items():  # PEFT targets a dense MLP layer's gate_proj ... as well
            in_f, out_f = (spec.intermediate_size, h) if part == "down" else (h, spec.intermediate_size)
            key = f"model.layers.{layer}.mlp.{name}"
            a, b = torch.randn(4, in_f, generator=gen) * 0.3, torch.randn(out_f, 4, generator=gen) * 0.3
            tensors[f"base_model.model.{key}.lora_A.weight"] = a
            tensors[f"base_model.model.{key}.lora_B.weight"] = b
            merged_deltas[key] = 2 * b @ a
    for layer in range(spec.num_layers):
        key = f"model.layers.{layer}.self_attn.q_proj"
        a, b = torch.randn(4, h, generator=gen) * 0.3, torch.randn(spec.q_size, 4, generator=gen) * 0.3
        tensors[f"base_model.model.{key}.lora_A.weight"] = a
        tensors[f"base_model.model.{key}.lora_B.weight"] = b
        merged_deltas[key] = 2 * b @ a
    out = tmp_path / f"per-expert-{family}"
    out.mkdir()
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", *names.values()],
           "rank_pattern": {f"experts.3.{names['gate']}": 1}}
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors, out / "adapter_model.safetensors")
    return out, merged_deltas


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_per_expert_adapter_matches_merged_weights(tmp_path, family):
    model_dir = make_tiny_moe_dir(tmp_path / "base", family, "per_expert", seed=12)
    spec = ModelSpec.from_dir(model_dir)
    adapter, deltas = _per_expert_adapter(tmp_path, family, spec)
    merged_dir = make_tiny_moe_dir(tmp_path / "merged", family, "per_expert", seed=12)
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32)
    state = merged.state_dict()
    fused = {}
    with torch.no_grad():
        for key, delta in deltas.items():  # transformers 5 holds the experts fused: add into its slices
            if ".experts." not in key:
                merged.get_submodule(key).weight += delta
                continue
            prefix, rest = key.split(".experts.")
            e, name = rest.split(".")
            fused.setdefault(prefix.replace("block_sparse_moe", "mlp"), []).append((int(e), name, delta))
        experts = spec.lora_target_spec(expert_lora=True).experts
        inter = experts.inter
        for prefix, items in fused.items():
            gate_up, down = state[f"{prefix}.experts.gate_up_proj"], state[f"{prefix}.experts.down_proj"]
            for e, name, delta in items:
                part = {v: k for k, v in experts.part_names.items()}[name]
                if part == "down":
                    down[e] += delta
                else:
                    gate_up[e, (0 if part == "gate" else inter):(inter if part == "gate" else 2 * inter)] += delta
    merged.save_pretrained(merged_dir)  # a plain checkpoint with the deltas in
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    lspec = spec.lora_target_spec(expert_lora=True)
    parsed = load_adapter_files(adapter)
    info = validate_adapter(parsed, lspec, max_lora_rank=4)
    assert (0, "gate", 1) in info.expert_modules and (0, "gate", 0) not in info.expert_modules
    assert info.expert_modules[(0, "gate", 3)].rank == 1
    weights = AdapterWeights.build(parsed, info, lspec, torch.float32)
    assert weights.nbytes == host_nbytes(info, lspec, torch.float32)
    assert torch.equal(weights.experts[0]["gate"].a[0], torch.zeros_like(weights.experts[0]["gate"].a[0]))

    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=tmp_path / "home", max_loras=2,
              max_lora_rank=4, kv_cache_bytes=4 << 20, enable_expert_lora=True)
    prompts = [[5 + (7 * i + j) % 250 for j in range(4 + 3 * i)] for i in range(4)]
    which = [None, adapter, adapter, None]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                        adapters=[None if w is None else str(w) for w in which])
    for prompt, w, out in zip(prompts, which, outs):
        assert out.token_ids == greedy(base if w is None else merged, prompt, 5)
    assert any(greedy(merged, p, 5) != greedy(base, p, 5) for p in prompts)


def test_slot_pool_holds_what_the_engine_reserves(tmp_path):
    """Rank 4, 6 experts of 64 -> 32 in the two sparse layers of the Qwen3-MoE: the expert stacks
    are 2 layers * 6 experts * 4 * 3 * (64 + 32) floats per slot, on top of the dense stacks."""
    model_dir = make_tiny_moe_dir(tmp_path / "base", "qwen3_moe", "per_expert", seed=1)
    spec = ModelSpec.from_dir(model_dir)
    on, off = spec.lora_target_spec(expert_lora=True), spec.lora_target_spec()
    expert_bytes = 4 * (2 * 6 * 4 * 3 * (64 + 32))
    assert max_adapter_host_nbytes(on, 4, torch.float32) - max_adapter_host_nbytes(off, 4, torch.float32) == expert_bytes
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    adapter = make_peft_adapter(base, tmp_path / "a", r=4, target_modules=["q_proj"], target_parameters=EXPERTS)
    parsed = load_adapter_files(adapter)
    info = validate_adapter(parsed, on, max_lora_rank=4)
    pool = SlotPool(on, max_loras=2, max_rank=4, device="cpu", dtype=torch.float32)
    pool.write(1, AdapterWeights.build(parsed, info, on, torch.float32))
    assert pool.experts.nbytes == 2 * expert_bytes
    assert pool.experts.active == [False, True] and pool.experts.slot_active.tolist() == [0, 1]
    assert pool.experts.slot_rank.tolist() == [0, 4]
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=tmp_path / "home", max_loras=3,
              max_lora_rank=4, kv_cache_bytes=4 << 20, enable_expert_lora=True)
    runner = llm.engine.runner
    full = SlotPool(on, max_loras=3, max_rank=4, device="cpu", dtype=torch.float32)
    full.write(0, AdapterWeights.build(parsed, info, on, torch.float32))  # the layers' and experts' stacks
    for module in on.vocab_shapes:
        full.vocab.allocate(module)
    # the reserve is every tensor of the pool at its largest: the weights, and the fp32 scalings
    # ([2, L, E] and [L, E] per sparse layer) and int32 ranks beside them
    assert runner.lora_slot_bytes() == held_tensor_bytes(full)
    assert runner.lora_slot_bytes() > 3 * max_adapter_host_nbytes(on, 4, torch.float32)


def _edit(src, dst, config: dict | None = None, tensors=None):
    """A copy of adapter ``src`` with ``config`` keys set and ``tensors(dict) -> dict`` applied."""
    from safetensors.torch import load_file

    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text()) | (config or {})
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    weights = load_file(src / "adapter_model.safetensors")
    save_file(tensors(weights) if tensors else weights, dst / "adapter_model.safetensors")
    return dst


def test_expert_adapters_the_engine_cannot_serve_are_refused(tmp_path):
    """On an engine with expert LoRA: router LoRA (as a module and as a parameter), a rank above
    max_lora_rank, shapes that do not fit the experts, both forms at once, an expert past the
    model's, a parameter nothing matches; each names the problem."""
    model_dir = make_tiny_moe_dir(tmp_path / "base", "qwen3_moe", "per_expert", seed=2)
    spec = ModelSpec.from_dir(model_dir).lora_target_spec(expert_lora=True)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    good = make_peft_adapter(base, tmp_path / "good", r=4, target_modules=["q_proj"], target_parameters=EXPERTS)
    validate_adapter(load_adapter_files(good), spec, max_lora_rank=4)
    P = "base_model.model.model.layers."
    cases = [
        (dict(target_parameters=[*EXPERTS, "mlp.gate.weight"]), None,
         r"target_parameters entry 'mlp.gate.weight' names a router's weight: LoRA on routers is not served"),
        (dict(target_parameters=[*EXPERTS, "mlp.experts.up_proj"]), None,
         r"target_parameters entry 'mlp.experts.up_proj' names no parameter .* serves LoRA on"),
        (dict(target_modules=["q_proj", "gate"]), lambda t: t | {
            f"{P}0.mlp.gate.lora_A.weight": torch.zeros(4, 64), f"{P}0.mlp.gate.lora_B.weight": torch.zeros(6, 4)},
         r"targets 'model\.layers\.0\.mlp\.gate', .*LoRA on the router of a mixture-of-experts model .* takes LoRA "
         r"on q_proj, .*, lm_head, the experts' gate/up/down\)"),
        (dict(r=2, lora_alpha=4), None,  # the files hold rank 4: shapes no longer fit the config's rank
         r"'base_model\.model\.model\.layers\.0\.mlp\.experts\.base_layer\.lora_A\.weight' has shape \[24, 64\], "
         r"base model needs \[12, 64\] \(rank 2 per expert, 6 experts\)"),
        (None, lambda t: {k: (v[:, :-1].contiguous() if k.endswith("experts.lora_A.weight") else v) for k, v in t.items()},
         r"experts\.lora_A\.weight' has shape \[24, 31\], base model needs \[24, 32\]"),
        (dict(target_modules=["q_proj", "gate_proj"]), lambda t: t | {
            f"{P}0.mlp.experts.1.gate_proj.lora_A.weight": torch.zeros(4, 64),
            f"{P}0.mlp.experts.1.gate_proj.lora_B.weight": torch.zeros(32, 4)},
         r"both as per-expert modules and as PEFT's fused target_parameters"),
        (dict(target_modules=["q_proj", "gate_proj"], target_parameters=None), lambda t: {
            k: v for k, v in t.items() if "experts" not in k} | {
            f"{P}0.mlp.experts.6.gate_proj.lora_A.weight": torch.zeros(4, 64),
            f"{P}0.mlp.experts.6.gate_proj.lora_B.weight": torch.zeros(32, 4)},
         r"is for expert 6, but base model .* has 6 experts per layer"),
        (dict(target_parameters=["mlp.experts.down_proj"]), None,  # gate_up's tensors sit one level deeper
         r"name \['down_proj'\] expert parameters in layer 0, which PEFT would not nest 1 deep"),
        (None, lambda t: {k: (v * 1e8 if k.endswith("experts.lora_B.weight") else v) for k, v in t.items()},
         r"module '0\.experts\.(gate_up|down)': its update .* beyond 65504"),  # would overflow the forward
    ]
    for i, (config, tensors, message) in enumerate(cases):
        bad = _edit(good, tmp_path / f"bad{i}", config, tensors)
        with pytest.raises(Exception, match=message) as caught:
            validate_adapter(load_adapter_files(bad), spec, max_lora_rank=4)
        assert type(caught.value).__name__ == "InvalidAdapterError"
    with pytest.raises(Exception, match=r"module 'model\.layers\.0\.mlp\.experts\.gate_up_proj' has rank 4, above "
                                        r"this engine's max_lora_rank 2"):
        validate_adapter(load_adapter_files(good), spec, max_lora_rank=2)


def test_registry_spec_follows_the_setting(tmp_path):
    """The registry CLI and the vLLM-style start validate against ``base_model_spec(settings)``:
    expert LoRA there exactly when the engine serves it."""
    from types import SimpleNamespace

    from loraplex.registry.base_model import base_model_spec

    model_dir = make_tiny_moe_dir(tmp_path / "base", "mixtral", "per_expert", seed=1)
    on = base_model_spec(SimpleNamespace(model=str(model_dir), home=tmp_path, enable_expert_lora=True))
    off = base_model_spec(SimpleNamespace(model=str(model_dir), home=tmp_path, enable_expert_lora=False))
    assert on.experts.enabled and not off.experts.enabled
    assert (on.experts.num_experts, on.experts.hidden, on.experts.inter, on.experts.style) == (6, 64, 96, "mixtral")


def test_all_linear_takes_per_expert_modules(tmp_path):
    """PEFT's ``all-linear`` on a transformers-4 Mixtral covers the experts' w1/w2/w3 linears too."""
    from safetensors.torch import load_file

    model_dir = make_tiny_moe_dir(tmp_path / "base", "mixtral", "per_expert", seed=12)
    spec = ModelSpec.from_dir(model_dir)
    adapter, _ = _per_expert_adapter(tmp_path, "mixtral", spec)
    tensors = load_file(adapter / "adapter_model.safetensors")
    for layer in range(spec.num_layers):
        for mod, out_f in (("k_proj", spec.kv_size), ("v_proj", spec.kv_size), ("o_proj", 64)):
            in_f = spec.q_size if mod == "o_proj" else 64
            tensors[f"base_model.model.model.layers.{layer}.self_attn.{mod}.lora_A.weight"] = torch.ones(4, in_f)
            tensors[f"base_model.model.model.layers.{layer}.self_attn.{mod}.lora_B.weight"] = torch.ones(out_f, 4)
    everything = _edit(adapter, tmp_path / "all-linear", {"target_modules": "all-linear"}, lambda t: tensors)
    lspec = spec.lora_target_spec(expert_lora=True)
    named = validate_adapter(load_adapter_files(adapter), lspec, max_lora_rank=4)
    info = validate_adapter(load_adapter_files(everything), lspec, max_lora_rank=4)
    assert info.expert_modules.keys() == named.expert_modules.keys() and len(info.expert_modules) == spec.num_layers * 5 * 3


def test_target_parameters_on_a_dense_model_or_malformed_are_refused(tmp_path):
    from loraplex.lora.adapter_config import parse_config
    from loraplex.lora.errors import InvalidAdapterError
    from tests.fixtures.peft_adapters import spec_for, tiny_llama

    base = tiny_llama(seed=3)
    adapter = make_peft_adapter(base, tmp_path / "q", r=2, target_modules=["q_proj"])
    with_params = _edit(adapter, tmp_path / "params", {"target_parameters": ["mlp.experts.gate_up_proj"]})
    with pytest.raises(InvalidAdapterError, match=r"target_parameters \['mlp\.experts\.gate_up_proj'\] \(PEFT's LoRA on "
                                                  r"raw parameters\) names no parameter base model 'tiny' serves LoRA on"):
        validate_adapter(load_adapter_files(with_params), spec_for(base), max_lora_rank=4)
    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 4}
    with pytest.raises(InvalidAdapterError, match="target_parameters must be a list of parameter names"):
        parse_config(json.dumps(cfg | {"target_parameters": "mlp.experts.gate_up_proj"}).encode())
    with pytest.raises(InvalidAdapterError, match="required field 'target_modules' is missing"):
        parse_config(json.dumps(cfg).encode())
    only_params = parse_config(json.dumps(cfg | {"target_parameters": EXPERTS}).encode())
    assert only_params.target_modules == () and only_params.target_parameters == tuple(EXPERTS)


def test_layers_to_transform_leaves_target_parameters_alone_as_in_peft(tmp_path):
    model_dir = make_tiny_moe_dir(tmp_path / "base", "mixtral", "per_expert", seed=1)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    adapter = make_peft_adapter(base, tmp_path / "a", r=2, target_modules=["q_proj"], layers_to_transform=[1],
                                target_parameters=["mlp.experts.gate_up_proj"])
    info = validate_adapter(load_adapter_files(adapter), ModelSpec.from_dir(model_dir).lora_target_spec(True), 4)
    assert sorted(info.modules) == [(1, "q_proj")]
    assert sorted(info.expert_modules) == [(layer, "gate_up", -1) for layer in range(3)]  # PEFT saved all three
