"""vLLM's ``max_logprobs`` engine option: requests asking more alternatives per token are
refused (vLLM's words), -1 lifts the cap to the vocabulary; the alternatives past OpenAI's 20
are checked against transformers' own log-softmax."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex.config import EngineConfig
from loraplex.engine.llm import LLM
from loraplex.sampling_params import InvalidRequestError, SamplingParams

PROMPT = list(range(30, 52))


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def make_llm(model_dir, home, max_logprobs: int) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", device="cpu", home=home, max_logprobs=max_logprobs)


def test_a_request_over_the_cap_is_refused_and_one_at_it_runs(tiny_llama_dir, loraplex_home):
    llm = make_llm(tiny_llama_dir, loraplex_home, max_logprobs=3)
    for field, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        with pytest.raises(InvalidRequestError) as info:
            llm.generate(PROMPT, SamplingParams(max_tokens=1, **{field: 4}))
        assert info.value.param == field
        assert str(info.value) == f"Requested {kind} logprobs of 4, which is greater than max allowed: 3"
    assert not llm.engine.has_unfinished()  # the refusals left nothing behind
    out = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0.0, logprobs=3, prompt_logprobs=3))[0]
    assert len(out.outputs[0].logprobs[0]["top_logprobs"]) >= 3


def test_no_cap_serves_more_than_twenty_alternatives_as_transformers_ranks_them(tiny_llama_dir, loraplex_home,
                                                                                 hf_model):
    llm = make_llm(tiny_llama_dir, loraplex_home, max_logprobs=-1)
    n = 40
    out = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0.0, logprobs=n))[0]
    entry = out.outputs[0].logprobs[0]
    with torch.no_grad():
        row = torch.log_softmax(hf_model(torch.tensor([PROMPT])).logits[0, -1].float(), dim=-1)
    top = row.topk(n)
    # the top n, in order (the greedy token is the first of them, so no extra entry)
    assert list(entry["top_logprobs"])[:n] == top.indices.tolist()
    assert list(entry["top_logprobs"].values())[:n] == pytest.approx(top.values.tolist(), abs=2e-4)
    vocab = llm.engine.vocab_size
    with pytest.raises(InvalidRequestError, match=f"max allowed: {vocab}$"):  # -1: the vocabulary
        llm.generate(PROMPT, SamplingParams(max_tokens=1, logprobs=vocab + 1))


def test_a_cap_below_minus_one_is_no_engine():
    with pytest.raises(ValueError, match="max_logprobs"):
        EngineConfig(max_logprobs=-2)
