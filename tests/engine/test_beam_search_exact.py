"""``LLM.beam_search`` (vLLM's offline beam search) against independent references over the same
transformers model in float32: a naive vLLM-semantics search written in the test (EOS-finished
beams, length penalty with the prompt in the length) and transformers' ``generate(num_beams=k)``
where the two semantics coincide (no EOS: every beam runs max_tokens, ranked by summed
logprob); with a PEFT adapter too."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex import BeamSearchParams, LLM, LoRARequest
from loraplex.sampling_params import InvalidRequestError
from tests.engine.beam_reference import hf_beam_search, make_eos_prone_model_dir, naive_vllm_beam_search

# lengths across the 16-token block edge, so step requests hit the prefix cache mid-block too
PROMPTS = [[5, 6, 7], list(range(10, 180, 10)), [200], list(range(40, 71, 2))]
ATOL = 2e-4


@pytest.fixture(scope="module")
def eos_model_dir(tmp_path_factory):
    return make_eos_prone_model_dir(tmp_path_factory.mktemp("beam-eos-model"))


@pytest.fixture(scope="module")
def hf_model(eos_model_dir):
    return AutoModelForCausalLM.from_pretrained(eos_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(eos_model_dir, tmp_path_factory):
    return LLM(model=str(eos_model_dir), dtype="float32", device="cpu", home=tmp_path_factory.mktemp("home"),
               block_size=16, max_num_seqs=8, max_num_batched_tokens=64)


def _assert_same(got, expected):
    assert [s.output_token_ids for s in got.sequences] == [e[0] for e in expected]
    for s, e in zip(got.sequences, expected):
        assert s.cum_logprob == pytest.approx(e[1], abs=ATOL)


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.5])
def test_matches_a_naive_vllm_beam_search(llm, hf_model, length_penalty):
    params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=length_penalty)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    reasons = set()
    for prompt, out in zip(PROMPTS, outs):
        expected = naive_vllm_beam_search(hf_model, prompt, 3, 6, length_penalty=length_penalty)
        _assert_same(out, expected)
        assert [s.finish_reason for s in out.sequences] == ["stop" if e[2] else "length" for e in expected]
        for s in out.sequences:
            assert s.tokens[: len(prompt)] == prompt
            assert s.text == llm.get_tokenizer().decode(s.tokens)  # vLLM's offline text: prompt and output
            assert len(s.logprobs) == len(s.output_token_ids)
        reasons |= {s.finish_reason for s in out.sequences}
    assert reasons == {"stop", "length"}  # both kinds of beam are compared
    assert llm.engine.num_unfinished_requests == 0
    assert llm.engine.stats()["num_blocks_free"] == llm.engine.stats()["num_blocks_total"]


@pytest.mark.parametrize("width", [2, 4])
def test_matches_transformers_generate_where_the_semantics_coincide(llm, hf_model, width):
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                           BeamSearchParams(beam_width=width, max_tokens=5, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        _assert_same(out, hf_beam_search(hf_model, prompt, width, 5))
        assert all(s.finish_reason == "length" for s in out.sequences)


def test_step_requests_reuse_the_prefix_cache(llm):
    before = llm.engine.stats()["prefix_cache_hits"]
    llm.beam_search([{"prompt_token_ids": list(range(100, 140))}], BeamSearchParams(beam_width=2, max_tokens=3))
    # 40 prompt tokens hold two full blocks: every step request after the first finds them
    assert llm.engine.stats()["prefix_cache_hits"] - before >= 2 * 16 * 4


def test_each_beam_runs_the_requests_adapter(eos_model_dir, hf_model, llm, tmp_path):
    from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for

    path = make_peft_adapter(hf_model, tmp_path / "a", seed=5, target_modules=["q_proj", "v_proj", "down_proj"])
    peft = peft_model_for(hf_model, {"a": path})
    prompts = PROMPTS[:2]
    both = llm.beam_search([{"prompt_token_ids": p} for p in prompts + prompts],
                           BeamSearchParams(beam_width=3, max_tokens=5),
                           lora_request=[LoRARequest("a", 1, str(path)), LoRARequest("a", 1, str(path)), None, None])
    for prompt, out in zip(prompts, both[:2]):
        _assert_same(out, naive_vllm_beam_search(peft, prompt, 3, 5))
    for prompt, out in zip(prompts, both[2:]):
        _assert_same(out, naive_vllm_beam_search(hf_model, prompt, 3, 5))
    assert [s.output_token_ids for s in both[0].sequences] != [s.output_token_ids for s in both[2].sequences]
    no_eos = llm.beam_search([{"prompt_token_ids": prompts[1]}], BeamSearchParams(beam_width=3, max_tokens=5,
                             ignore_eos=True), lora_request=LoRARequest("a", 1, str(path)))[0]
    _assert_same(no_eos, hf_beam_search(peft, prompts[1], 3, 5))


def test_concurrency_limit_and_text_prompts_change_nothing(llm):
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    prompts = ["hello", {"prompt": "a longer prompt"}, {"prompt_token_ids": [7, 8, 9]}]
    together = llm.beam_search(prompts, params)
    one_by_one = llm.beam_search(prompts, params, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in together] == [[s.tokens for s in o.sequences] for o in one_by_one]
    assert together[0].sequences[0].tokens[: len(llm.get_tokenizer()("hello")["input_ids"])] == \
        llm.get_tokenizer()("hello")["input_ids"]


def test_bad_requests_raise_and_leave_nothing_queued(llm):
    with pytest.raises(InvalidRequestError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(InvalidRequestError, match="max_logprobs"):  # 2 x 11 candidates > the default cap 20
        llm.beam_search(["x"], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(InvalidRequestError, match="prompt"):
        llm.beam_search([{"prompt_token_ids": [5]}, {"prompt_token_ids": [10 ** 6]}],
                        BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(InvalidRequestError, match="BeamSearchParams"):
        llm.beam_search(["x"], {"beam_width": 2})
    assert llm.engine.num_unfinished_requests == 0
