"""vLLM's ``cache_salt``: prefix-cache blocks are shared only between requests with the same salt
(and adapter), so one user cannot time whether another's prompt is cached. Outputs do not depend
on the salt (transformers' greedy decoding is the reference); the prompt-dict form of
``LLM.generate`` carries it, as vLLM's offline API does."""

from __future__ import annotations

import pytest
import torch

from loraplex import SamplingParams
from loraplex.sampling_params import InvalidRequestError
from tests.engine.test_engine_exact import hf_greedy_all, tight_llm

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4)


def _hits(llm) -> int:
    return llm.engine.stats()["prefix_cache_hits"]


def test_blocks_are_shared_only_under_the_same_salt(tiny_llama_dir, loraplex_home):
    torch.manual_seed(3)
    prompt = torch.randint(4, 300, (40,)).tolist()  # two full blocks of 16
    llm = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=64, enable_prefix_caching=True)
    expected = hf_greedy_all(tiny_llama_dir, [prompt], 4)[0]

    def run(salt):
        item = {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}
        before = _hits(llm)
        out = llm.generate([item], PARAMS)[0]
        assert out.token_ids == expected
        return _hits(llm) - before

    assert run("alice") == 0  # cold
    assert run("bob") == 0  # same tokens, another salt: nothing shared
    assert run(None) == 0  # no salt is a salt of its own
    assert run("alice") == 32 and run("bob") == 32 and run(None) == 32  # each finds its own blocks
    stats = llm.engine.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"]


def test_prompt_dicts_and_bad_salts(tiny_llama_dir, loraplex_home):
    llm = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=64)
    text = llm.generate({"prompt": "hello there", "cache_salt": "s"}, PARAMS)[0]
    assert text.token_ids == llm.generate("hello there", PARAMS)[0].token_ids
    for bad in ({"prompt": "x", "prompt_token_ids": [5]}, {"cache_salt": "s"}, {"prompt": "x", "salt": "s"}):
        with pytest.raises(TypeError, match="prompt dict"):
            llm.generate([bad], PARAMS)
    for salt in ("", 7):
        with pytest.raises(InvalidRequestError, match="cache_salt"):
            llm.generate({"prompt_token_ids": [5, 6], "cache_salt": salt}, PARAMS)
    assert llm.engine.num_unfinished_requests == 0


def test_a_salt_that_is_not_utf8_text_keeps_the_engine_running(tiny_llama_dir, loraplex_home):
    """A lone surrogate in a salt (a str the offline API or an AsyncLLMEngine caller passes on)
    raised UnicodeEncodeError inside the scheduler, which stops the async engine's loop."""
    llm = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=64, enable_prefix_caching=True)
    prompt = list(range(5, 45))
    outs = [llm.generate({"prompt_token_ids": prompt, "cache_salt": salt}, PARAMS)[0].token_ids
            for salt in ("\ud800", "\ud801", "\ud800")]
    assert outs[0] == outs[1] == outs[2] and llm.engine.stats()["prefix_cache_hits"] == 32  # only the same salt hit
