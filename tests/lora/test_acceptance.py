"""Acceptance: one ``LLM.generate`` over a tiny random GQA Llama with 9 PEFT adapters (ranks 1..64,
different targets, rsLoRA, rank/alpha patterns, layers_to_transform, regex targets) and the base
model, 3 device slots and a host budget that forces evictions: every greedy output is
token-identical (float32) to PEFT's own model with that adapter."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.sampling_params import SamplingParams
from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for

MAX_TOKENS = 8
ADAPTERS = {
    "r1": dict(r=1, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
    "r2": dict(r=2, lora_alpha=3, target_modules=["k_proj", "o_proj"], fan_in_fan_out=True),
    "r4": dict(r=4, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "r8_rslora": dict(r=8, lora_alpha=5, use_rslora=True, target_modules="all-linear"),
    "r16_patterns": dict(
        r=16,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        rank_pattern={"k_proj": 4, "layers.1.self_attn.o_proj": 2},
        alpha_pattern={"v_proj": 3, "o_proj": 20},
    ),
    "r32_layer1": dict(r=32, lora_alpha=12, target_modules=["q_proj", "down_proj"], layers_to_transform=[1]),
    "r64_all": dict(
        r=64,
        lora_alpha=32,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "r8_regex": dict(r=8, lora_alpha=2, target_modules=r".*\.0\.self_attn\.(q|v)_proj|.*\.1\.mlp\.up_proj"),
    "r2_up_down": dict(r=2, lora_alpha=1, target_modules=["up_proj", "down_proj"]),
}


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding with full recomputation: the independent reference."""
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def reference(peft_model, prompt, adapter: str | None, n: int = MAX_TOKENS) -> list[int]:
    if adapter is None:
        with peft_model.disable_adapter():
            return greedy(peft_model, prompt, n)
    peft_model.set_adapter(adapter)
    return greedy(peft_model, prompt, n)


@pytest.fixture(scope="module")
def setup(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from loraplex.engine.llm import LLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("acceptance-adapters")
    dirs = {name: make_peft_adapter(base, root / name, seed=100 + i, **kw) for i, (name, kw) in enumerate(ADAPTERS.items())}
    dirs["r4_v2"] = make_peft_adapter(base, root / "r4_v2", seed=999, **ADAPTERS["r4"])
    peft_model = peft_model_for(base, dirs)
    sizes = {n: sum(f.stat().st_size for f in d.iterdir() if f.suffix == ".safetensors") for n, d in dirs.items()}
    llm = LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        device="cpu",
        kv_cache_bytes=16 << 20,
        max_loras=3,
        max_lora_rank=64,
        max_cpu_lora_bytes=sum(sizes.values()) // 4,  # far from all adapters: forces host evictions
        max_num_seqs=16,
    )
    return llm, dirs, peft_model


@pytest.mark.slow
def test_mixed_batch_matches_peft(setup):
    llm, dirs, peft_model = setup
    rng = random.Random(0)
    names = [n for n in ADAPTERS]
    registered = names[::2]  # half by registered name, half by directory path
    for n in registered:
        llm.add_adapter(n, str(dirs[n]))
    choices = [None, *names]
    prompts, adapters, which = [], [], []
    for i in range(40):
        adapter = choices[i % len(choices)]
        prompts.append([rng.randrange(4, 260) for _ in range(rng.randrange(2, 14))])
        which.append(adapter)
        adapters.append(None if adapter is None else adapter if adapter in registered else str(dirs[adapter]))
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), adapters=adapters)

    mismatches = []
    for prompt, adapter, out in zip(prompts, which, outs):
        expected = reference(peft_model, prompt, adapter)
        if out.token_ids != expected:
            mismatches.append((adapter, prompt, out.token_ids, expected))
    assert not mismatches, mismatches
    # adapters change outputs (else the comparison above proves nothing about LoRA)
    base_outs = [reference(peft_model, p, None) for p, a in zip(prompts, which) if a is not None]
    lora_outs = [o.token_ids for o, a in zip(outs, which) if a is not None]
    assert sum(b != o for b, o in zip(base_outs, lora_outs)) >= len(lora_outs) // 2

    stats = llm.engine.lora_manager.stats()
    per = stats["adapters"].values()
    assert sum(a["evictions"] for a in per) > 0  # 9 adapters through 3 device slots
    assert sum(a["host_evictions"] for a in per) > 0  # host budget below the adapters' total
    assert sum(a["requests"] for a in per) == sum(a is not None for a in which)


def test_reregistered_name_serves_new_weights_at_once(setup):
    llm, dirs, peft_model = setup
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = [5, 77, 140, 33, 9]
    llm.add_adapter("swap", str(dirs["r4"]))
    [old] = llm.generate([prompt], params, adapters=["swap"])
    manager = llm.engine.lora_manager
    old_id = manager.resolve("swap")
    assert manager.tier_of(old_id) == "device"
    assert old.token_ids == reference(peft_model, prompt, "r4")

    llm.add_adapter("swap", str(dirs["r4_v2"]))
    [new] = llm.generate([prompt], params, adapters=["swap"])
    assert manager.tier_of(old_id) == "device"  # the old weights still sit in a slot, unused
    expected_new = reference(peft_model, prompt, "r4_v2")
    assert expected_new != old.token_ids
    assert new.token_ids == expected_new
