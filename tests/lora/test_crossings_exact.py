"""Every path at once against PEFT: prefix-cache hits, chunked prefill (24 tokens a step),
preemption under a 7-block KV cache and a mixed batch of the base model and three adapters
through two device slots (rank/alpha patterns, layers_to_transform, rsLoRA), on models whose
own features cross these paths: Gemma 2 (soft-caps, a 24-position window on layers 0 and 2),
Phi-3 (fused qkv / gate_up adapters, partial rotary), Mistral with a 24-position window, Gemma 1
(scaled embeddings, tied head) and Qwen2 (q/k/v bias).
Greedy tokens must equal PEFT's unmerged model on transformers (float32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex import LLM, SamplingParams
from loraplex.model.config import ModelSpec
from tests.engine.test_prefix_hit_counter import count_every_allocation
from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.fixtures.tiny_phi3 import make_tiny_phi3_dir
from tests.lora.test_acceptance import reference

MAX_TOKENS = 5
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
ADAPTERS = {
    "unfused": {
        "patterns": dict(r=8, lora_alpha=16, target_modules=SEVEN, rank_pattern={"k_proj": 2, "layers.1.mlp.down_proj": 5},
                         alpha_pattern={"v_proj": 3, "o_proj": 20}),
        "layer1": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], layers_to_transform=[1]),
        "rslora": dict(r=2, lora_alpha=3, use_rslora=True, target_modules=["gate_proj", "up_proj"]),
    },
    "fused": {
        "patterns": dict(r=8, lora_alpha=16, target_modules=FUSED, rank_pattern={"qkv_proj": 2, "layers.1.mlp.down_proj": 5},
                         alpha_pattern={"gate_up_proj": 3, "o_proj": 20}),
        "layer1": dict(r=4, lora_alpha=8, target_modules=["qkv_proj", "gate_up_proj"], layers_to_transform=[1]),
        "rslora": dict(r=2, lora_alpha=3, use_rslora=True, target_modules=FUSED, layers_to_transform=[0]),
    },
}
MODELS = {  # Gemma 1 and Qwen2 (q/k/v bias) have no adapter test of their own
    "gemma": (lambda path: make_tiny_model_dir(path, "gemma", seed=3), "unfused"),
    "qwen2": (lambda path: make_tiny_model_dir(path, "qwen2", seed=3), "unfused"),
    "gemma2": (lambda path: make_tiny_model_dir(path, "gemma2", seed=3), "unfused"),
    "phi3": (lambda path: make_tiny_phi3_dir(path, seed=3, partial_rotary_factor=0.75), "fused"),
    "mistral_window": (lambda path: make_tiny_model_dir(path, "mistral", seed=3, sliding_window=24), "unfused"),
}
# KV blocks of 16 tokens: few enough that sequences are preempted. A model whose every layer is
# windowed gives back the blocks that slid out of the window, so it needs an even smaller cache
KV_BLOCKS = {"mistral_window": 5}


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_prefix_cache_chunks_preemption_and_adapters_match_peft(kind, tmp_path, monkeypatch):
    # every admission's cache hits, re-admissions after preemption included: the global counter
    # counts first admissions only, and here the 7 blocks have evicted the first call's prefixes
    # before the second call's first admissions, so its hits are re-admissions onto cached blocks
    all_hits = count_every_allocation(monkeypatch)
    make_model, family = MODELS[kind]
    model_dir = make_model(tmp_path / "model")
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()
    dirs = {name: make_peft_adapter(base, tmp_path / name, seed=i + 1, **kw)
            for i, (name, kw) in enumerate(ADAPTERS[family].items())}
    peft_model = peft_model_for(base, dirs)
    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(4, 300, (40,), generator=gen).tolist()  # two full 16-token blocks
    prompts = [shared + torch.randint(4, 300, (n,), generator=gen).tolist() for n in (1, 9, 20, 33, 50, 17)]
    which = [None, "patterns", "layer1", "rslora", "layer1", "patterns"]
    adapters = [None if w is None else str(dirs[w]) for w in which]
    kv_per_token = ModelSpec.from_dir(model_dir, name="t").kv_bytes_per_token(4)
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=tmp_path / "home", max_loras=2, max_lora_rank=8,
              block_size=16, kv_cache_bytes=KV_BLOCKS.get(kind, 7) * 16 * kv_per_token, max_num_batched_tokens=24, max_num_seqs=8,
              enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate(prompts[:4], params, adapters=adapters[:4])  # the shared prefix cached per adapter
    outs = llm.generate(prompts, params, adapters=adapters)
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0, stats
    assert sum(all_hits) > 0 and stats["num_blocks_free"] == stats["num_blocks_total"], stats
    expected = [reference(peft_model, prompt, w, MAX_TOKENS) for prompt, w in zip(prompts, which)]
    assert [out.token_ids for out in outs] == expected
    base_tokens = [reference(peft_model, prompt, None, MAX_TOKENS) for prompt in prompts]
    for name in dirs:  # each adapter changes a prompt it served, else LoRA went untested
        assert any(expected[i] != base_tokens[i] for i, w in enumerate(which) if w == name), name
