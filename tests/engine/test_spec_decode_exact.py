"""Speculative decoding changes no output: with n-gram drafts on, greedy outputs (and seeded
sampled ones) are token for token those of plain one-token decoding, under prefix caching,
chunked prefill, preemption, stop conditions inside a step's accepted drafts, penalties,
logprobs and LoRA adapters; and every KV block comes back."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.block_manager import FREED_BLOCK
from loraplex.sampling_params import SamplingParams
from tests.engine.spec_helpers import (
    assert_blocks_all_free,
    assert_drafts_accepted_and_rejected,
    make_llm,
    repeating_prompts,
)
from tests.engine.test_engine_exact import kv_bytes_per_token

GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


def run_both(model_dir, home, prompts, params, adapters=None, **options):
    """(outputs without speculation, outputs with it, the speculative LLM)."""
    plain = make_llm(model_dir, home, spec=False, **options).generate(prompts, params, adapters=adapters)
    llm = make_llm(model_dir, home, spec=True, **options)
    spec = llm.generate(prompts, params, adapters=adapters)
    return plain, spec, llm


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_identical_with_speculation(tiny_llama_dir, loraplex_home, prefix_caching):
    prompts = repeating_prompts()
    plain, spec, llm = run_both(tiny_llama_dir, loraplex_home, prompts, GREEDY,
                                enable_prefix_caching=prefix_caching)
    assert token_ids(spec) == token_ids(plain)
    assert [o.text for o in spec] == [o.text for o in plain]
    assert [o.finish_reason for o in spec] == [o.finish_reason for o in plain]
    assert_drafts_accepted_and_rejected(llm)
    assert_blocks_all_free(llm)


def test_preemption_and_chunked_prefill(tiny_llama_dir, loraplex_home):
    """A KV cache of 24 blocks of 16 tokens and 48 tokens a step for 11 sequences of up to ~80
    tokens: prompts are chunked, sequences preempted, and drafts compete for the token budget."""
    options = dict(block_size=16, kv_cache_bytes=24 * 16 * kv_bytes_per_token(tiny_llama_dir),
                   max_num_batched_tokens=48, max_num_seqs=11)
    prompts = repeating_prompts()
    plain, spec, llm = run_both(tiny_llama_dir, loraplex_home, prompts, GREEDY, **options)
    assert token_ids(spec) == token_ids(plain)
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0, stats
    assert_drafts_accepted_and_rejected(llm)
    assert_blocks_all_free(llm)


def test_prefix_cache_registers_only_accepted_tokens(tiny_llama_dir, loraplex_home):
    """After every step, each block a sequence registered holds computed tokens only, under the
    hash of the sequence's own tokens; a second round whose prompts are the first round's
    prompt + output (so it takes those blocks from the cache) still matches plain decoding."""
    llm = make_llm(tiny_llama_dir, loraplex_home, spec=True, block_size=4)
    engine, bm = llm.engine, llm.engine.block_manager
    prompts = repeating_prompts()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        for seq in engine.scheduler.running:
            registered = bm._num_registered.get(seq.seq_id, 0)
            assert registered * bm.block_size <= seq.num_computed_tokens
            for i, block in enumerate(seq.block_table[:registered]):
                if block != FREED_BLOCK and bm._block_hash[block] is not None:
                    assert bm._block_hash[block] == seq.block_hashes[i]
    assert_drafts_accepted_and_rejected(llm)
    second = [p + finals[f"r{i}"].token_ids[:25] for i, p in enumerate(prompts)]
    again = llm.generate(second, GREEDY)
    assert engine.stats()["prefix_cache_hits"] > 0
    plain = make_llm(tiny_llama_dir, loraplex_home, spec=False, enable_prefix_caching=False).generate(second, GREEDY)
    assert token_ids(again) == token_ids(plain)
    assert_blocks_all_free(llm)


def looping_continuations(model_dir, home) -> tuple[list[list[int]], list]:
    """Prompts that end inside the plain greedy output's own loop (prompt + its first 20 output
    tokens), and their plain greedy outputs: drafts found in the prompt predict those outputs
    from the first step, so a stop condition at a token's first occurrence in the output falls
    inside a step's accepted drafts."""
    prompts = repeating_prompts(count=4)
    first = make_llm(model_dir, home, spec=False).generate(prompts, GREEDY)
    continued = [p + out.token_ids[:20] for p, out in zip(prompts, first)]
    return continued, make_llm(model_dir, home, spec=False).generate(continued, GREEDY)


def test_stop_tokens_and_max_tokens_inside_drafts(tiny_llama_dir, loraplex_home):
    """Stop tokens at their first occurrence in the output (mostly inside accepted drafts), and
    every max_tokens from 1 to 12: the speculative run stops at the same token."""
    prompts, reference = looping_continuations(tiny_llama_dir, loraplex_home)
    params, all_prompts = [], []
    for prompt, out in zip(prompts, reference):
        for token in dict.fromkeys(out.token_ids[1:12]):
            params.append(SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[token]))
            all_prompts.append(prompt)
    num_stop = len(params)
    params += [SamplingParams(temperature=0.0, max_tokens=m) for m in range(1, 13)]
    all_prompts += [prompts[m % len(prompts)] for m in range(1, 13)]
    plain, spec, llm = run_both(tiny_llama_dir, loraplex_home, all_prompts, params)
    assert token_ids(spec) == token_ids(plain)
    assert [o.outputs[0].stop_reason for o in spec] == [o.outputs[0].stop_reason for o in plain]
    assert all(o.finish_reason == "stop" for o in spec[:num_stop])
    for out, p in zip(spec, params):
        assert len(out.token_ids) <= p.max_tokens
    assert llm.engine.stats()["generation_tokens_total"] == sum(len(o.token_ids) for o in spec)
    assert_drafts_accepted_and_rejected(llm)
    assert_blocks_all_free(llm)


def test_stop_strings_and_min_tokens(tiny_llama_dir, loraplex_home):
    """Stop strings at many places of the output, so that some complete inside a step's
    accepted drafts: the tokens after one are dropped (and not counted as generated)."""
    prompts, reference = looping_continuations(tiny_llama_dir, loraplex_home)
    cases = [(prompt, out.text[k : k + 2], m) for prompt, out in zip(prompts, reference)
             for k in range(1, 24, 2) if len(out.text) >= k + 2 for m in (0, 3)]
    params = [SamplingParams(temperature=0.0, max_tokens=40, stop=[stop], min_tokens=m) for _, stop, m in cases]
    plain, spec, llm = run_both(tiny_llama_dir, loraplex_home, [p for p, _, _ in cases], params)
    assert token_ids(spec) == token_ids(plain)
    assert [o.text for o in spec] == [o.text for o in plain]
    assert [o.outputs[0].stop_reason for o in spec] == [o.outputs[0].stop_reason for o in plain]
    assert sum(o.finish_reason == "stop" for o in spec) > len(cases) // 2
    assert llm.engine.stats()["generation_tokens_total"] == sum(len(o.token_ids) for o in spec)
    assert_blocks_all_free(llm)


def test_penalties_logit_bias_and_logprobs(tiny_llama_dir, loraplex_home):
    """Each verified position sees the earlier accepted tokens in its penalty counts; logprobs
    of each token come from its own position."""
    prompts = repeating_prompts(count=7)  # 10 prompts
    params = 2 * [
        SamplingParams(temperature=0.0, max_tokens=30, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, max_tokens=30, frequency_penalty=0.3, presence_penalty=0.2),
        SamplingParams(temperature=0.0, max_tokens=30, logit_bias={7: 3.0, 9: -2.0}),
        SamplingParams(temperature=0.0, max_tokens=30, logprobs=2, repetition_penalty=1.1),
    ]
    plain, spec, llm = run_both(tiny_llama_dir, loraplex_home, prompts, params)
    assert token_ids(spec) == token_ids(plain)
    assert len(llm.engine.runner.sampler.prompts) == 0  # the prompts kept for the penalty are released
    for a, b in zip(spec, plain):
        if b.outputs[0].logprobs is None:
            continue
        for ea, eb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert ea["token_id"] == eb["token_id"]
            assert ea["logprob"] == pytest.approx(eb["logprob"], abs=1e-4)
            assert set(ea["top_logprobs"]) == set(eb["top_logprobs"])
    assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0


def test_seeded_sampling_n2_identical(tiny_llama_dir, loraplex_home):
    """Seeded sampling draws each token's noise from (seed, index, tokens so far), with drafts or
    without: n=2 children speculate each on their own and match plain decoding exactly."""
    prompts = repeating_prompts(count=4)
    params = SamplingParams(temperature=0.3, top_k=5, max_tokens=30, n=2, seed=11)
    plain, spec, llm = run_both(tiny_llama_dir, loraplex_home, prompts, params)
    assert token_ids(spec) == token_ids(plain)
    assert any(c.token_ids != out.outputs[0].token_ids for out in spec for c in out.outputs[1:])
    assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0
    assert_blocks_all_free(llm)


@pytest.mark.slow  # ~40 s on a shared 2-core VM (three engines and two PEFT adapters)
def test_lora_adapters_mixed_in_one_batch(tiny_llama_dir, loraplex_home, tmp_path):
    """The verifying pass runs each sequence's drafts through its own adapter."""
    from transformers import AutoModelForCausalLM

    from tests.fixtures.peft_adapters import make_peft_adapter

    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    a = make_peft_adapter(base, tmp_path / "a", seed=1, r=4)
    b = make_peft_adapter(base, tmp_path / "b", seed=2, r=8, target_modules=["o_proj", "down_proj"])
    prompts = repeating_prompts(count=6)
    adapters = [[None, str(a), str(b)][i % 3] for i in range(len(prompts))]
    plain, spec, llm = run_both(tiny_llama_dir, loraplex_home, prompts, GREEDY, adapters=adapters,
                                max_lora_rank=8)
    assert token_ids(spec) == token_ids(plain)
    base_only = make_llm(tiny_llama_dir, loraplex_home, spec=True).generate(prompts, GREEDY)
    assert token_ids(base_only) != token_ids(spec)  # the adapters do change the outputs
    assert_drafts_accepted_and_rejected(llm)
    assert_blocks_all_free(llm)


def test_sliding_window_frees_only_what_accepted_tokens_passed(tmp_path_factory, loraplex_home):
    """A sliding-window model (window 24, blocks of 4): blocks slide out as accepted tokens
    advance, and outputs still match plain decoding."""
    from tests.fixtures.tiny_models import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("swa"), "mistral", seed=8, sliding_window=24)
    prompts = repeating_prompts()
    plain, spec, llm = run_both(model_dir, loraplex_home, prompts, GREEDY, block_size=4)
    assert llm.engine.block_manager.sliding_window == 24
    assert token_ids(spec) == token_ids(plain)
    assert_drafts_accepted_and_rejected(llm)
    assert_blocks_all_free(llm)


def test_structured_output_and_unseeded_sampling_alongside_drafts(tiny_llama_dir, loraplex_home):
    """A grammar-constrained request decodes one token a step (no drafts) in a batch whose
    other requests speculate, and matches plain decoding; unseeded sampled requests finish
    with their lengths and give every block back."""
    import re

    from loraplex.structured_output import StructuredOutputs

    prompts = repeating_prompts(count=3)
    pattern = "[a-c]{3,8}-[0-9]{2}"
    params = [SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=StructuredOutputs(regex=pattern))]
    params += [GREEDY] * (len(prompts) - 1)
    plain, spec, llm = run_both(tiny_llama_dir, loraplex_home, prompts, params)
    assert token_ids(spec) == token_ids(plain)
    assert re.fullmatch(pattern, spec[0].text), spec[0].text
    assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0
    sampled = llm.generate(prompts, SamplingParams(temperature=0.8, max_tokens=24, n=2, ignore_eos=True))
    assert all(len(c.token_ids) == 24 for out in sampled for c in out.outputs)
    assert_blocks_all_free(llm)
