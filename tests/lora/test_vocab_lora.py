"""LoRA on embed_tokens and lm_head (Unsloth's continued-pretraining targets), served on the CPU
path: one batch mixing the base model, adapters on the embedding only, the head only, both plus
attention (rank/alpha patterns, rsLoRA) and an attention-only adapter gives PEFT's own greedy
tokens and logprobs, and prompt logprobs equal PEFT's log-softmax, on untied and tied Llama,
Granite (embedding multiplier, logits scaling), Gemma 2 (final soft-cap) and Gemma 3 (scaled
embedding module), float32."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex import LLM, SamplingParams
from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.lora.test_acceptance import reference

MAX_TOKENS = 6
ADAPTERS = {
    "embed": dict(r=4, lora_alpha=8, target_modules=["embed_tokens"]),
    "head": dict(r=4, lora_alpha=6, target_modules=["lm_head"]),
    "both": dict(r=8, lora_alpha=5, use_rslora=True, target_modules=["embed_tokens", "lm_head", "q_proj", "v_proj"],
                 rank_pattern={"lm_head": 2}, alpha_pattern={"embed_tokens": 7}),
    "qv": dict(r=4, target_modules=["q_proj", "v_proj"]),
}


def _peft_logprobs(peft_model, adapter: str | None, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """PEFT's log-softmax at every position of prompt + generated (but the last): [n - 1, vocab]."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        if adapter is None:
            with peft_model.disable_adapter():
                logits = peft_model(input_ids=ids).logits[0]
        else:
            peft_model.set_adapter(adapter)
            logits = peft_model(input_ids=ids).logits[0]
    return torch.log_softmax(logits[:-1].float(), dim=-1)


@pytest.fixture(scope="module", params=["llama", "tied", "granite", "gemma2", "gemma3"])
def world(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"vocab-{request.param}")
    model_dir = make_tiny_model_dir(root / "model", request.param, seed=5)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()
    dirs = {name: make_peft_adapter(base, root / name, seed=40 + i, **kw)
            for i, (name, kw) in enumerate(ADAPTERS.items())}
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=root / "home", max_loras=4, max_lora_rank=8,
              max_num_batched_tokens=48)  # the long prompts are chunked
    return llm, dirs, peft_model_for(base, dirs)


def test_mixed_batch_tokens_and_logprobs_match_peft(world):
    llm, dirs, peft_model = world
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(4, 300, (n,), generator=gen).tolist() for n in (6, 30, 11, 45, 20, 8, 13)]
    which = [None, "embed", "head", "both", "qv", "both", "embed"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2),
                        adapters=[None if w is None else str(dirs[w]) for w in which])
    expected = [reference(peft_model, prompt, adapter, MAX_TOKENS) for prompt, adapter in zip(prompts, which)]
    assert [out.outputs[0].token_ids for out in outs] == expected
    for prompt, adapter, out in zip(prompts, which, outs):
        ref = _peft_logprobs(peft_model, adapter, prompt, out.outputs[0].token_ids)[len(prompt) - 1 :]
        for step, entry in enumerate(out.outputs[0].logprobs):
            assert entry["logprob"] == pytest.approx(float(ref[step, entry["token_id"]]), abs=2e-4)
            top = ref[step].topk(2)
            assert list(entry["top_logprobs"].values()) == pytest.approx(top.values.tolist(), abs=2e-4)
    # the vocabulary adapters matter: each changes the greedy tokens of some prompt it serves
    base = [reference(peft_model, prompt, None, MAX_TOKENS) for prompt in prompts]
    for name in ("embed", "head", "both"):
        assert any(expected[i] != base[i] for i in range(len(prompts)) if which[i] == name), name


def test_prompt_logprobs_match_peft(world):
    llm, dirs, peft_model = world
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(4, 300, (n,), generator=gen).tolist() for n in (70, 9, 40)]  # 70: three chunks
    which = ["both", None, "head"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3),
                        adapters=[None if w is None else str(dirs[w]) for w in which])
    for prompt, adapter, out in zip(prompts, which, outs):
        ref = _peft_logprobs(peft_model, adapter, prompt, [])
        entries = out.prompt_logprobs
        assert entries[0] is None and len(entries) == len(prompt)
        for pos, entry in enumerate(entries[1:], start=1):
            row = ref[pos - 1]
            assert entry["logprob"] == pytest.approx(float(row[prompt[pos]]), abs=2e-4)
            assert entry["rank"] == int((row > row[prompt[pos]]).sum()) + 1
            # the reference's three best, by value: tokens of equal logprob may come in either
            # order (the random tiny gemma2 ties some to the last bit)
            assert [float(row[t]) for t in entry["top_logprobs"]] == pytest.approx(row.topk(3).values.tolist(), abs=2e-4)


def test_vocab_slot_buffers_exist_only_once_an_adapter_needs_them(tiny_llama_dir, tmp_path):
    """Device bytes: none for embed_tokens / lm_head until an adapter targeting them is loaded,
    then max_loras x r_max x (vocab + hidden) elements (+ per-slot scaling and rank) per target."""
    import json

    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    qv = make_peft_adapter(base, tmp_path / "qv", seed=1, **ADAPTERS["qv"])
    head = make_peft_adapter(base, tmp_path / "head", seed=2, **ADAPTERS["head"])
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", device="cpu", home=tmp_path / "home", max_loras=2,
              max_lora_rank=8, kv_cache_bytes=4 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([[5, 6, 7]], params, adapters=[str(qv)])
    stats = llm.engine.lora_manager.stats()
    assert stats["slot_vocab_bytes"] == 0 and stats["slot_bytes"] > 0
    llm.generate([[5, 6, 7]], params, adapters=[str(head)])
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    head_bytes = 4 * 2 * 8 * (vocab + hidden) + 2 * (4 + 4)  # fp32 A and B; fp32 scaling, int32 rank
    after = llm.engine.lora_manager.stats()
    assert after["slot_vocab_bytes"] == head_bytes
    assert after["slot_bytes"] == stats["slot_bytes"] + head_bytes


def test_speculative_verification_rows_get_the_head_lora(tiny_llama_dir, tmp_path):
    """n-gram drafts verified in one forward: every verified row's logits carry its adapter's
    lm_head LoRA, so the accepted tokens are PEFT's greedy ones."""
    from tests.engine.spec_helpers import assert_drafts_accepted_and_rejected, make_llm, repeating_prompts

    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    dirs = {name: make_peft_adapter(base, tmp_path / name, seed=50 + i, **ADAPTERS[name])
            for i, name in enumerate(("head", "both"))}
    peft_model = peft_model_for(base, dirs)
    llm = make_llm(tiny_llama_dir, tmp_path / "home", spec=True, max_loras=2, max_lora_rank=8)
    prompts = repeating_prompts(count=4, seed=3)
    which = ["head", "both", None, "both", "head", None, "head"][: len(prompts)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                        adapters=[None if w is None else str(dirs[w]) for w in which])
    expected = [reference(peft_model, p, w, 12) for p, w in zip(prompts, which)]
    assert [out.outputs[0].token_ids for out in outs] == expected
    assert_drafts_accepted_and_rejected(llm)


def test_tied_adapters_from_ensure_weight_tying_match_peft(tiny_tied_dir, tmp_path):
    """``ensure_weight_tying=True`` on a tied model ties lm_head's LoRA to the embedding's
    (lora_A = lora_embedding_B.T, lora_B = lora_embedding_A.T); PEFT saves both, and serving them
    as two deltas gives PEFT's tokens."""
    from safetensors.torch import load_file

    base = AutoModelForCausalLM.from_pretrained(str(tiny_tied_dir), dtype=torch.float32).eval()
    tied = make_peft_adapter(base, tmp_path / "tied", seed=9, r=4, target_modules=["embed_tokens", "lm_head"],
                             ensure_weight_tying=True)
    t = load_file(str(tied / "adapter_model.safetensors"))
    assert torch.equal(t["base_model.model.lm_head.lora_A.weight"],
                       t["base_model.model.model.embed_tokens.lora_embedding_B"].t())
    peft_model = peft_model_for(base, {"tied": tied})
    llm = LLM(model=str(tiny_tied_dir), dtype="float32", device="cpu", home=tmp_path / "home", max_loras=2,
              max_lora_rank=8, kv_cache_bytes=4 << 20)
    prompts = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        adapters=[str(tied), None])
    expected = [reference(peft_model, p, w, MAX_TOKENS) for p, w in zip(prompts, ["tied", None])]
    assert [out.outputs[0].token_ids for out in outs] == expected
    assert expected[0] != reference(peft_model, prompts[0], None, MAX_TOKENS)


def test_one_slot_reused_by_adapters_with_and_without_vocab_targets(tiny_llama_dir, tmp_path):
    """max_loras=1: each adapter evicts the last from the one device slot, so the slot's
    embed_tokens / lm_head rows go from set to cleared and back; every output is PEFT's."""
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    dirs = {name: make_peft_adapter(base, tmp_path / name, seed=60 + i, **ADAPTERS[name])
            for i, name in enumerate(("both", "qv", "embed"))}
    peft_model = peft_model_for(base, dirs)
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", device="cpu", home=tmp_path / "home", max_loras=1,
              max_lora_rank=8, kv_cache_bytes=4 << 20, enable_prefix_caching=False)
    prompt = [9, 30, 31, 12, 50]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for name in ("both", "qv", "embed", "qv", "both", None):
        out = llm.generate([prompt], params, adapters=[None if name is None else str(dirs[name])])[0]
        assert out.outputs[0].token_ids == reference(peft_model, prompt, name, MAX_TOKENS), name
    stats = llm.engine.lora_manager.stats()["adapters"]
    assert sum(s["evictions"] for s in stats.values()) >= 4  # the slot changed hands each time
