"""Acceptance: the full engine (scheduler + block manager + model runner) is greedy
token-for-token identical to transformers' ``generate`` in float32 on CPU, under a KV budget
and token budget small enough that the same run preempts and chunks prefills."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex.engine.async_engine import AsyncLLMEngine
from loraplex.engine.llm import LLM
from loraplex.sampling_params import InvalidRequestError, SamplingParams
from tests.model.helpers import assert_sampled_logprobs

PROMPT_LENGTHS = (1, 2, 3, 7, 15, 16, 17, 31, 48, 64, 90, 128, 160, 200, 255, 300)
MAX_TOKENS = 10


def kv_bytes_per_token(model_dir) -> int:
    from loraplex.model.config import ModelSpec

    return ModelSpec.from_dir(model_dir, name="t").kv_bytes_per_token(4)


def tight_llm(model_dir, home, num_blocks: int = 40, **options) -> LLM:
    """Block size 16, ``num_blocks`` KV blocks (640 tokens for 16 prompts of ~2000 tokens in all)
    and 64 tokens per step: the run must both preempt and chunk."""
    options = {
        "block_size": 16,
        "kv_cache_bytes": num_blocks * 16 * kv_bytes_per_token(model_dir),
        "max_num_batched_tokens": 64,
        "max_num_seqs": 16,
        **options,
    }
    return LLM(model=str(model_dir), dtype="float32", device="cpu", home=home, **options)


def hf_greedy_all(model_dir, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' batched greedy ``generate`` (left padding; its positions follow the mask)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):] = torch.tensor(prompt)
        mask[i, width - len(prompt):] = 1
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
            do_sample=False, pad_token_id=2,
        )
    return out[:, width:].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_tied_dir"])
def test_greedy_matches_transformers_with_preemption_and_chunking(fixture, request, loraplex_home):
    model_dir = request.getfixturevalue(fixture)
    torch.manual_seed(0)
    prompts = [torch.randint(4, 300, (n,)).tolist() for n in PROMPT_LENGTHS]
    llm = tight_llm(model_dir, loraplex_home)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    outputs = llm.generate(prompts, params)
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0, stats
    assert stats["num_chunked_prefills"] > 0, stats
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    expected = hf_greedy_all(model_dir, prompts, MAX_TOKENS)
    for prompt, out, ref in zip(prompts, outputs, expected):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == ref, f"prompt of {len(prompt)} tokens"
        assert out.finish_reason == "length"


def test_llm_api_options_prompts_and_errors(tiny_llama_dir, loraplex_home, caplog):
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(model=str(tiny_llama_dir), home=loraplex_home, max_num_seq=4)
    with caplog.at_level(logging.INFO, logger="loraplex.engine"):
        llm = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=64, max_loras=3)
    # 2 (K and V) x 2 layers x 2 KV heads x 16 head dim x 4 bytes
    # sequences of max_model_len tokens that 64 blocks of 16 hold at once (no window: every block kept)
    concurrency = 64 / -(-llm.engine.max_model_len // 16)
    for fragment in ("kv_bytes_per_token=512", "num_blocks=64", f"max_concurrency={concurrency:.1f}", "max_loras=3",
                     "max_lora_rank=64", "max_cpu_lora_bytes="):
        assert fragment in caplog.text
    params = SamplingParams(temperature=0.0, max_tokens=5)
    tok = llm.get_tokenizer()
    single = llm.generate("hello there", params)
    assert len(single) == 1 and single[0].prompt_token_ids == list(tok("hello there")["input_ids"])
    by_ids = llm.generate(single[0].prompt_token_ids, params)
    assert by_ids[0].token_ids == single[0].token_ids
    mixed = llm.generate(["a b c", [5, 6, 7, 8]], [params, SamplingParams(temperature=0.0, max_tokens=2)])
    assert len(mixed[0].token_ids) <= 5 and len(mixed[1].token_ids) <= 2
    assert tok.decode(mixed[0].token_ids, skip_special_tokens=True).startswith(mixed[0].text)
    too_long = [5] * llm.engine.max_model_len
    for bad_prompt in ([], "", too_long):
        with pytest.raises(InvalidRequestError) as info:
            llm.generate(["fine", bad_prompt], params)
        assert info.value.param == "prompt"
    assert not llm.engine.has_unfinished()  # the good prompt of a rejected batch never started
    with pytest.raises(InvalidRequestError) as info:
        llm.generate("x", [params, params])
    assert info.value.param == "params"


def test_seeded_sampling_reproducible_through_engine(tiny_llama_dir, loraplex_home):
    llm = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=20)
    prompt = list(range(4, 60))
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, seed=1234)
    alone = llm.generate(prompt, seeded)[0].token_ids
    # the same request inside a crowded batch (other requests, preemptions) samples the same
    crowd = [list(range(4 + i, 60 + i)) for i in range(4)]
    crowded = llm.generate([*crowd, prompt], [SamplingParams(temperature=1.0, max_tokens=12)] * 4 + [seeded])
    assert crowded[-1].token_ids == alone
    other_seed = llm.generate(prompt, SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, seed=99))
    assert other_seed[0].token_ids != alone


def test_async_engine_real_model_two_streams_abort_one(tiny_qwen2_dir, loraplex_home):
    llm = tight_llm(tiny_qwen2_dir, loraplex_home, num_blocks=64)
    expected = llm.generate([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=20))[0]
    aengine = AsyncLLMEngine(llm.config, engine=llm.engine)

    async def stream(prompt, max_tokens, request_id, abort_after=None):
        tokens, text = [], ""
        async for delta in aengine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), request_id):
            tokens += delta.outputs[0].token_ids
            text += delta.outputs[0].text
            if abort_after is not None and len(tokens) >= abort_after:
                aengine.abort(request_id)
                abort_after = None
            last = delta
        return tokens, text, last

    async def main():
        return await asyncio.gather(stream([5, 6, 7, 8], 20, "a"), stream(list(range(4, 200)), 300, "b", abort_after=2))

    try:
        (tok_a, text_a, last_a), (tok_b, _, last_b) = asyncio.run(main())
        stats = aengine.stats()
    finally:
        aengine.shutdown()
    assert tok_a == expected.token_ids and text_a == expected.text
    assert last_a.finished and last_a.outputs[0].finish_reason == "length"
    assert last_b.finished and last_b.outputs[0].finish_reason == "abort" and len(tok_b) < 300
    assert stats["num_blocks_free"] == stats["num_blocks_total"]


def test_prefix_caching_reuses_kv_and_keeps_outputs(tiny_llama_dir, loraplex_home):
    torch.manual_seed(1)
    shared = torch.randint(4, 300, (40,)).tolist()  # two full blocks of 16 shared by every prompt
    prompts = [shared + torch.randint(4, 300, (n,)).tolist() for n in (1, 5, 17, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
    plain = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=64, enable_prefix_caching=False)
    plain = plain.generate(prompts, params)
    llm = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=64, enable_prefix_caching=True)
    llm.generate(prompts[:1], params)
    cached = llm.generate(prompts, params)
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] >= 4 * 32
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    assert stats["num_blocks_free"] == stats["num_blocks_total"]


def test_prefix_shared_within_one_step_matches_transformers(tiny_llama_dir, loraplex_home):
    # cold cache, all prompts in one step: the first prompt's two prefix blocks are filled and
    # read by the other three in that same step. The step computes 413 - 96 = 317 tokens, so
    # the prompt-sized GEMM path (PLAIN_GEMM_MIN_ROWS) runs too.
    torch.manual_seed(2)
    shared = torch.randint(4, 300, (40,)).tolist()
    prompts = [shared + torch.randint(4, 300, (n,)).tolist() for n in (1, 5, 17, 230)]
    llm = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=64, max_num_batched_tokens=512)
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6))
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] == 3 * 32
    assert llm.engine.scheduler.stats.num_steps == 6  # one step for every prompt, then decodes
    assert [o.token_ids for o in out] == hf_greedy_all(tiny_llama_dir, prompts, 6)
    assert stats["num_blocks_free"] == stats["num_blocks_total"]


def test_logprobs_through_engine_match_transformers(tiny_llama_dir, loraplex_home):
    llm = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=64)
    prompt = list(range(4, 40))
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5, min_tokens=5, logprobs=3))[0]
    assert len(out.token_ids) == 5
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    assert_sampled_logprobs(model, prompt, out, 3)
