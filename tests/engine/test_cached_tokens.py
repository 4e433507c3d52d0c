"""Each request's prefix-cache hits (``RequestOutput.num_cached_tokens``, vLLM's) on a real tiny
engine: the whole blocks of a prompt that an earlier request left cached, counted once, when the
request is first admitted. The expected numbers are worked out here from the block size and the
prompts' shared lengths, not read from the engine: a prompt of ``L`` tokens sharing its first
``s`` with a cached one reports ``min(s // B, (L - 1) // B) * B`` (whole blocks of ``B``, and
the last prompt token is always computed, so a step samples from real logits)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex import LoRARequest, SamplingParams
from tests.engine.spec_helpers import NGRAM, repeating_prompts
from tests.engine.test_engine_exact import PROMPT_LENGTHS, tight_llm
from tests.engine.test_hybrid_kv_exact import BLOCK as HYBRID_BLOCK
from tests.engine.test_hybrid_kv_exact import LAYER_TYPES, WINDOW, _llm
from tests.fixtures.peft_adapters import make_peft_adapter

BLOCK = 16  # tight_llm's block size
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def expected_hits(length: int, shared: int, block: int = BLOCK) -> int:
    return min(shared // block, (length - 1) // block) * block


def random_ids(seed: int, n: int) -> list[int]:
    return torch.randint(4, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def llm(tiny_llama_dir, loraplex_home):
    return tight_llm(tiny_llama_dir, loraplex_home, num_blocks=128, enable_prefix_caching=True,
                     max_num_batched_tokens=256)


def one(llm, prompt: list[int], params: SamplingParams = GREEDY, **kw):
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, **kw)
    return out


def test_a_shared_prefix_reports_its_whole_cached_blocks(llm):
    a = random_ids(1, 70)
    first = one(llm, a)
    assert first.num_cached_tokens == 0  # nothing cached yet
    b = a[:50] + random_ids(2, 20)  # the first 50 tokens shared, then another text
    assert one(llm, b).num_cached_tokens == expected_hits(len(b), 50) == 48
    again = one(llm, a)
    assert again.num_cached_tokens == expected_hits(len(a), len(a)) == 64
    assert again.token_ids == first.token_ids  # the hits serve the same output
    whole = random_ids(3, 4 * BLOCK)  # a prompt of whole blocks: its last token is computed again
    assert one(llm, whole).num_cached_tokens == 0
    assert one(llm, whole).num_cached_tokens == expected_hits(len(whole), len(whole)) == 3 * BLOCK
    assert one(llm, random_ids(4, 70)).num_cached_tokens == 0  # a fresh prompt
    short = a[:BLOCK]  # its one block is cached, but then no token would be left to compute
    assert one(llm, short).num_cached_tokens == expected_hits(BLOCK, BLOCK) == 0


def test_the_count_is_per_prompt_and_does_not_grow_with_the_request_s_own_blocks(llm):
    a = random_ids(5, 70)
    # n > 1: the siblings share the first one's blocks, which is no hit of the request
    before = llm.engine.stats()["prefix_cache_hits"]
    sampled = SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=4)
    assert one(llm, a, sampled).num_cached_tokens == 0
    assert llm.engine.stats()["prefix_cache_hits"] - before == 2 * expected_hits(len(a), len(a))
    assert one(llm, a, sampled).num_cached_tokens == expected_hits(len(a), len(a))
    # several prompts in one call: each its own number
    b = a[:40] + random_ids(6, 30)
    outs = llm.generate([{"prompt_token_ids": p} for p in (b, random_ids(7, 30))], GREEDY)
    assert [o.num_cached_tokens for o in outs] == [expected_hits(len(b), 40), 0]
    # prompt logprobs need the whole prompt's logits: nothing is taken from the cache
    logprobs = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    assert one(llm, a, logprobs).num_cached_tokens == 0


def test_another_adapter_or_salt_gets_no_hits_from_the_base_s_blocks(llm, tiny_llama_dir, tmp_path):
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    lora = LoRARequest("a", 1, str(make_peft_adapter(base, tmp_path / "a", seed=2)))
    a = random_ids(8, 70)
    full = expected_hits(len(a), len(a))
    assert one(llm, a).num_cached_tokens == 0
    assert one(llm, a, lora_request=lora).num_cached_tokens == 0  # the adapter's KV is its own
    assert one(llm, a, lora_request=lora).num_cached_tokens == full
    assert one(llm, a).num_cached_tokens == full
    (salted,) = llm.generate([{"prompt_token_ids": a, "cache_salt": "s"}], GREEDY)
    assert salted.num_cached_tokens == 0


def test_a_preempted_request_keeps_its_first_admission_s_count(tiny_llama_dir, loraplex_home):
    """Re-admitted after preemption, a sequence finds much of its own recomputed context cached;
    that is no hit of the request (vLLM counts the first admission only)."""
    llm = tight_llm(tiny_llama_dir, loraplex_home, enable_prefix_caching=True)  # preempts and chunks
    prompts = [random_ids(100 + i, n) for i, n in enumerate(PROMPT_LENGTHS)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0
    assert [o.num_cached_tokens for o in outs] == [0] * len(prompts)  # distinct prompts: no request hit
    assert stats["prefix_cache_hits"] == 0  # nor in the global counter (test_prefix_hit_counter.py)


def test_speculative_decoding_counts_the_same(tiny_llama_dir, loraplex_home):
    """Drafts are not the sequence's tokens: their blocks are never registered, and the count is
    the prompt's, set before any draft."""
    llm = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=128, enable_prefix_caching=True,
                    max_num_batched_tokens=256, speculative_config=NGRAM)
    a = max(repeating_prompts(), key=len)  # a repeated segment: drafts from the first decode
    repeat = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert one(llm, a, repeat).num_cached_tokens == 0
    assert llm.engine.stats()["spec_decode_num_drafts"] > 0
    assert one(llm, a, repeat).num_cached_tokens == expected_hits(len(a), len(a))


def test_windowed_and_global_layer_groups_report_one_number(tmp_path_factory, loraplex_home):
    """Gemma 2 (windowed and global layers, one block table each): a hit is the blocks every
    group takes, those before the window included (their KV is not recomputed, never read)."""
    from tests.fixtures.tiny_models import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("gemma2"), "gemma2", seed=11, sliding_window=WINDOW,
                                    num_hidden_layers=len(LAYER_TYPES["gemma2"]), layer_types=LAYER_TYPES["gemma2"])
    llm = _llm(model_dir, loraplex_home, num_pages=256, enable_prefix_caching=True)
    shared = random_ids(10, 23)  # past the window of 10
    first, second = shared + random_ids(11, 3), shared + random_ids(12, 14)
    assert one(llm, first).num_cached_tokens == 0
    assert one(llm, second).num_cached_tokens == expected_hits(len(second), len(shared), HYBRID_BLOCK) == 20
    assert one(llm, second).num_cached_tokens == expected_hits(len(second), len(second), HYBRID_BLOCK)


def test_a_prompt_longer_than_a_step_counts_the_hits_of_its_first_chunk(tiny_llama_dir, loraplex_home):
    """Chunked prefill (32 tokens a step): the hits are those found when the first chunk is
    admitted, whole cached blocks however many chunks the rest takes; the later chunks' lookups
    are no new admissions. n > 1 reports the prompt's hits once."""
    llm = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=128, enable_prefix_caching=True,
                    max_num_batched_tokens=32)
    a = random_ids(20, 90)
    first = one(llm, a)
    assert first.num_cached_tokens == 0
    assert llm.engine.stats()["num_chunked_prefills"] > 0
    b = a[:50] + random_ids(21, 60)  # 110 tokens: 48 cached, then 62 in two chunks
    assert one(llm, b).num_cached_tokens == expected_hits(len(b), 50) == 48
    again = one(llm, a, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, n=2))
    assert again.num_cached_tokens == expected_hits(len(a), len(a)) == 80
    assert [c.token_ids for c in again.outputs] == [first.token_ids] * 2
