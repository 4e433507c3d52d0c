"""A KV slot holds whatever its block's last owner wrote until a new owner overwrites it, and a
NaN there (an adapter whose forward overflowed) must not reach anyone else: here every slot of
the cache starts NaN, and ragged batches of base-model prompts (decodes padded past shorter
sequences, chunks, preemption) still give transformers' greedy tokens. Before the CPU
attention zeroed the keys no query may attend, such a cache turned the outputs to token 0."""

from __future__ import annotations

import math

import torch

from loraplex.sampling_params import SamplingParams
from tests.engine.test_engine_exact import hf_greedy_all, tight_llm

MAX_TOKENS = 8


def test_nan_left_in_the_cache_reaches_no_output(tiny_llama_dir, loraplex_home):
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 300, (n,), generator=gen).tolist() for n in (5, 40, 17, 90, 33, 3, 61, 12)]
    llm = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=12)
    for storage in llm.engine.runner.kv_storage:
        storage.fill_(math.nan)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=1)
    outputs = llm.generate(prompts, params)
    stats = llm.engine.stats()
    assert stats["num_chunked_prefills"] > 0 and stats["num_preemptions"] > 0, stats
    for out, ref in zip(outputs, hf_greedy_all(tiny_llama_dir, prompts, MAX_TOKENS)):
        assert out.token_ids == ref
        assert all(math.isfinite(entry["logprob"]) for entry in out.outputs[0].logprobs)
