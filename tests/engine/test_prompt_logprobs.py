"""Prompt logprobs (vLLM's ``prompt_logprobs``) against an independent reference: the
transformers model's (or PEFT's) own log-softmax over the whole prompt in one forward."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex.engine.llm import LLM
from loraplex.sampling_params import InvalidRequestError, SamplingParams
from tests.engine.test_engine_exact import tight_llm
from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for

TOP_N = 3


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def reference(model, prompt: list[int]) -> torch.Tensor:  # [len(prompt) - 1, vocab]
    """Log-probabilities of the next token after each prompt position but the last."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)


def check(entries, prompt: list[int], ref: torch.Tensor, top_n: int = TOP_N) -> None:
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None  # nothing predicts the first token
    for pos, entry in enumerate(entries[1:], start=1):
        row = ref[pos - 1]
        token = prompt[pos]
        assert entry["token_id"] == token
        assert entry["logprob"] == pytest.approx(float(row[token]), abs=2e-4)
        assert entry["rank"] == int((row > row[token]).sum()) + 1
        top = row.topk(top_n)
        assert list(entry["top_logprobs"]) == top.indices.tolist()
        assert list(entry["top_logprobs"].values()) == pytest.approx(top.values.tolist(), abs=2e-4)


def test_prompt_logprobs_match_transformers_through_chunks_and_a_shared_prefix(tiny_llama_dir, loraplex_home, hf_model):
    # 64 tokens per step: the 150-token prompts are computed in three chunks; the two prompts
    # share their first 96 tokens, so with prefix caching the second would normally skip them
    llm = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=64, enable_prefix_caching=True)
    shared = [(7 * i) % 200 + 3 for i in range(96)]
    prompts = [shared + list(range(10, 64)), shared + list(range(250, 304))]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP_N)
    plain = llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert plain.prompt_logprobs is None  # not asked, not computed
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        check(out.prompt_logprobs, prompt, reference(hf_model, prompt))
    assert outs[0].token_ids == plain.token_ids  # the generated tokens are unchanged


def test_rank_and_zero_top_n(tiny_llama_dir, loraplex_home, hf_model):
    llm = tight_llm(tiny_llama_dir, loraplex_home)
    prompt = list(range(40, 61))
    out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    check(out.prompt_logprobs, prompt, reference(hf_model, prompt), top_n=0)
    assert all(e["top_logprobs"] == {} for e in out.prompt_logprobs[1:])
    one = llm.generate([5], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert one.prompt_logprobs == [None]


def test_prompt_logprobs_with_an_adapter_and_n_2(tiny_llama_dir, hf_model, tmp_path, loraplex_home):
    adapter = make_peft_adapter(hf_model, tmp_path / "a", seed=5, r=8, target_modules="all-linear")
    peft_model = peft_model_for(hf_model, {"a": adapter})
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", device="cpu", home=loraplex_home, max_loras=2, max_lora_rank=8)
    prompt = list(range(60, 100))
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=2, prompt_logprobs=TOP_N)
    out = llm.generate([prompt], params, adapters=[str(adapter)])[0]
    peft_model.set_adapter("a")
    check(out.prompt_logprobs, prompt, reference(peft_model, prompt))
    assert len(out.outputs) == 2


def test_out_of_range_is_refused():
    # the upper bound is the engine's max_logprobs (tests/engine/test_max_logprobs.py)
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(prompt_logprobs=-1)
    assert info.value.param == "prompt_logprobs"


def test_preempted_sequences_report_each_prompt_logprob_once(tiny_llama_dir, loraplex_home, hf_model):
    # 20 blocks (320 tokens) for 6 prompts of 60 tokens that each grow by 24: some are preempted
    # and recompute their prompt, which must neither repeat nor lose entries
    llm = tight_llm(tiny_llama_dir, loraplex_home, num_blocks=20)
    prompts = [[(13 * i + 5 * j) % 300 + 4 for j in range(60)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=TOP_N)
    outs = llm.generate(prompts, params)
    assert llm.engine.stats()["num_preemptions"] > 0
    for prompt, out in zip(prompts, outs):
        check(out.prompt_logprobs, prompt, reference(hf_model, prompt))
