"""On a real tiny engine, an adapter whose LoRA cannot change K/V (lm_head only, or the last
layer's modules after its K/V) takes the base model's cached prefix blocks, and the base takes
its; its tokens and logprobs are those of the same engine with prefix caching off (no sharing at
all) and PEFT's. Adapters that do change K/V (attention, embed_tokens) get no base hits, the
tenant / cache_salt isolation is the base's, and a name re-pointed at a version that touches
attention stops sharing. Expected hits: ``(len(prompt) - 1) // 16 * 16`` (whole blocks, the last
prompt token always computed)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex import SamplingParams
from loraplex.server.generation import cache_salt
from tests.engine.test_engine_exact import tight_llm
from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for
from tests.lora.test_acceptance import reference

BLOCK = 16
MAX_TOKENS = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
AFTER_KV = ["o_proj", "gate_proj", "up_proj", "down_proj"]


def whole_blocks(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK * BLOCK


def random_ids(seed: int, n: int = 70) -> list[int]:
    return torch.randint(4, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def world(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("share-base")
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    last = base.config.num_hidden_layers - 1
    kinds = {
        "head": dict(target_modules=["lm_head"]),
        "last": dict(target_modules=AFTER_KV, layers_to_transform=[last]),
        "qkv": dict(target_modules=["q_proj", "k_proj", "v_proj"]),
        "embed": dict(target_modules=["embed_tokens"]),
    }
    dirs = {name: make_peft_adapter(base, root / name, seed=20 + i, **kw) for i, (name, kw) in enumerate(kinds.items())}
    engines = {cached: tight_llm(tiny_llama_dir, root / f"home-{cached}", num_blocks=128, max_num_batched_tokens=256,
                                 enable_prefix_caching=cached, max_loras=4, max_lora_rank=4)
               for cached in (True, False)}
    return engines, dirs, peft_model_for(base, dirs)


def run(llm, prompt: list[int], adapter=None, salt: str | None = None):
    item = {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}
    (out,) = llm.generate([item], PARAMS, adapters=[adapter])
    return out


def logprobs(out) -> list[tuple[int, float]]:
    return [(e["token_id"], e["logprob"]) for e in out.outputs[0].logprobs]


def assert_same_as_uncached_and_peft(world, out, prompt: list[int], adapter: str | None):
    engines, dirs, peft_model = world
    plain = run(engines[False], prompt, None if adapter is None else str(dirs[adapter]))
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids == reference(peft_model, prompt, adapter, MAX_TOKENS)
    for (tok, lp), (plain_tok, plain_lp) in zip(logprobs(out), logprobs(plain)):
        assert tok == plain_tok and lp == pytest.approx(plain_lp, abs=1e-5)
    ids = torch.tensor([prompt + out.outputs[0].token_ids])
    with torch.no_grad():
        if adapter is None:
            with peft_model.disable_adapter():
                logits = peft_model(input_ids=ids).logits[0]
        else:
            peft_model.set_adapter(adapter)
            logits = peft_model(input_ids=ids).logits[0]
    ref = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)
    for step, (tok, lp) in enumerate(logprobs(out)):
        assert lp == pytest.approx(float(ref[step, tok]), abs=2e-4)


@pytest.mark.parametrize("adapter", ["head", "last"])
def test_an_adapter_that_leaves_kv_alone_shares_the_base_s_blocks(world, adapter):
    engines, dirs, _ = world
    llm = engines[True]
    prompt = random_ids(1 if adapter == "head" else 2)
    assert run(llm, prompt).num_cached_tokens == 0
    out = run(llm, prompt, str(dirs[adapter]))
    assert out.num_cached_tokens == whole_blocks(prompt) == 64
    assert_same_as_uncached_and_peft(world, out, prompt, adapter)
    # the other way round: the base finds the blocks the adapter's request computed
    fresh = random_ids(3 if adapter == "head" else 4)
    assert run(llm, fresh, str(dirs[adapter])).num_cached_tokens == 0
    base_out = run(llm, fresh)
    assert base_out.num_cached_tokens == whole_blocks(fresh)
    assert_same_as_uncached_and_peft(world, base_out, fresh, None)


@pytest.mark.parametrize("adapter", ["qkv", "embed"])
def test_an_adapter_that_changes_kv_gets_no_base_hits(world, adapter):
    engines, dirs, _ = world
    llm = engines[True]
    prompt = random_ids(5 if adapter == "qkv" else 6)
    assert run(llm, prompt).num_cached_tokens == 0
    out = run(llm, prompt, str(dirs[adapter]))
    assert out.num_cached_tokens == 0
    assert_same_as_uncached_and_peft(world, out, prompt, adapter)
    assert run(llm, prompt, str(dirs[adapter])).num_cached_tokens == whole_blocks(prompt)  # its own blocks
    assert run(llm, prompt, str(dirs["head"])).num_cached_tokens == whole_blocks(prompt)  # the base's


def test_tenants_and_salts_stay_apart_as_for_the_base(world):
    """The server's salts (``generation.cache_salt``: tenant, then the request's salt): the
    adapter's requests share blocks with the base's of the same tenant and salt only."""
    engines, dirs, _ = world
    llm, head = engines[True], str(dirs["head"])
    prompt = random_ids(7)
    alice, bob = cache_salt("tenant", "alice", None), cache_salt("tenant", "bob", None)
    alice_s1 = cache_salt("tenant", "alice", "s1")
    assert run(llm, prompt, salt=alice).num_cached_tokens == 0
    assert run(llm, prompt, head, salt=bob).num_cached_tokens == 0
    assert run(llm, prompt, head, salt=alice_s1).num_cached_tokens == 0
    assert run(llm, prompt, head).num_cached_tokens == 0  # no salt (offline): none of those
    assert run(llm, prompt, head, salt=alice).num_cached_tokens == whole_blocks(prompt)
    assert run(llm, prompt, salt=bob).num_cached_tokens == whole_blocks(prompt)  # bob's adapter request's


def test_a_name_re_pointed_at_an_attention_version_stops_sharing(world):
    engines, dirs, peft_model = world
    llm = engines[True]
    prompt = random_ids(8)
    llm.add_adapter("swap", str(dirs["head"]))
    assert run(llm, prompt).num_cached_tokens == 0
    assert run(llm, prompt, "swap").num_cached_tokens == whole_blocks(prompt)
    llm.add_adapter("swap", str(dirs["qkv"]))  # the new version touches attention
    out = run(llm, prompt, "swap")
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == reference(peft_model, prompt, "qkv", MAX_TOKENS)
    llm.add_adapter("swap", str(dirs["last"]))  # and back to one that leaves K/V alone
    assert run(llm, prompt, "swap").num_cached_tokens == whole_blocks(prompt)


def test_windowed_and_global_layer_groups_share_the_same_way(tmp_path):
    """Gemma 2 with windowed and global layers (one block table each): a last-layer adapter takes
    the base's pages of every group, those before the window included, and still answers PEFT's
    tokens and the uncached engine's."""
    from tests.engine.test_hybrid_kv_exact import BLOCK as PAGE
    from tests.engine.test_hybrid_kv_exact import LAYER_TYPES, WINDOW, _llm
    from tests.fixtures.tiny_models import make_tiny_model_dir

    types = LAYER_TYPES["gemma2"]
    model_dir = make_tiny_model_dir(tmp_path / "gemma2", "gemma2", seed=11, sliding_window=WINDOW,
                                    num_hidden_layers=len(types), layer_types=types)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()
    last = make_peft_adapter(base, tmp_path / "last", seed=3, target_modules=AFTER_KV, layers_to_transform=[len(types) - 1])
    peft_model = peft_model_for(base, {"last": last})
    prompt = random_ids(9, 30)  # three windows long
    outs = {}
    for cached in (True, False):
        llm = _llm(model_dir, tmp_path / f"home-{cached}", num_pages=256, enable_prefix_caching=cached, max_loras=2,
                   max_lora_rank=4)
        run(llm, prompt)
        outs[cached] = run(llm, prompt, str(last))
    assert outs[True].num_cached_tokens == (len(prompt) - 1) // PAGE * PAGE == 28
    assert outs[False].num_cached_tokens == 0
    assert outs[True].outputs[0].token_ids == outs[False].outputs[0].token_ids == reference(
        peft_model, prompt, "last", MAX_TOKENS)
    for (tok, lp), (plain_tok, plain_lp) in zip(logprobs(outs[True]), logprobs(outs[False])):
        assert tok == plain_tok and lp == pytest.approx(plain_lp, abs=1e-5)


def test_crossed_with_speculation_chunks_preemption_and_prompt_logprobs(world, tiny_llama_dir, tmp_path):
    """One batch of prompts with a common head, served by the base, the two K/V-keeping adapters
    and the two K/V-changing ones side by side, under n-gram speculation, chunked prefill (32
    tokens a step) and preemption (12 blocks), twice (the second time on the cache the first
    left, base blocks written by adapter requests included); one request asks prompt logprobs
    (it takes no hit). Every output is PEFT's, and the K/V-keeping adapters took hits."""
    from tests.engine.spec_helpers import NGRAM

    _, dirs, peft_model = world
    llm = tight_llm(tiny_llama_dir, tmp_path / "home", num_blocks=12, max_num_batched_tokens=32, max_num_seqs=6,
                    enable_prefix_caching=True, max_loras=4, max_lora_rank=4, speculative_config=NGRAM)
    gen = torch.Generator().manual_seed(12)
    head = torch.randint(4, 300, (36,), generator=gen).tolist()
    prompts = []
    for i in range(6):
        segment = torch.randint(4, 300, (4 + i,), generator=gen).tolist()
        prompts.append(head + segment * 3)
    which = [None, "head", "last", "qkv", "embed", "head"]
    adapters = [None if w is None else str(dirs[w]) for w in which]
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                             prompt_logprobs=1 if i == 2 else None) for i in range(len(prompts))]
    expected = [reference(peft_model, p, w, 8) for p, w in zip(prompts, which)]
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapters=adapters)
        assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0, stats
    assert stats["spec_decode_num_drafts"] > 0, stats
    assert outs[1].num_cached_tokens > 0 and outs[5].num_cached_tokens > 0
    assert outs[2].num_cached_tokens == 0  # prompt logprobs: computed whole
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
