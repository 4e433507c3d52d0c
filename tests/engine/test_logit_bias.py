"""``logit_bias`` through the whole engine, against an independent torch reference: the
transformers model's own logits, biased and argmaxed step by step here."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex.sampling_params import InvalidRequestError, SamplingParams
from tests.engine.test_engine_exact import hf_greedy_all, tight_llm

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture
def llm(tiny_llama_dir, loraplex_home):
    return tight_llm(tiny_llama_dir, loraplex_home, num_blocks=64)


def reference_greedy(model, prompt: list[int], bias: dict[int, float], steps: int) -> list[int]:
    """Greedy decoding with ``bias`` added to the model's logits at every step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].clone()
            for token, value in bias.items():
                logits[token] += value
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def test_plus_100_forces_the_token(llm, hf_model):
    prompt = list(range(20, 45))
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logit_bias={123: 100}))[0]
    assert out.token_ids == [123] * MAX_TOKENS
    assert out.token_ids == reference_greedy(hf_model, prompt, {123: 100.0}, MAX_TOKENS)


def test_minus_100_on_greedy_token_gives_second_best(llm, hf_model):
    prompt = list(range(50, 80))
    with torch.no_grad():
        first, second = hf_model(torch.tensor([prompt])).logits[0, -1].topk(2).indices.tolist()
    plain = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1))[0].token_ids
    assert plain == [first]
    bias = {first: -100.0}
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logit_bias=bias))[0]
    assert out.token_ids[0] == second
    assert first not in out.token_ids
    assert out.token_ids == reference_greedy(hf_model, prompt, bias, MAX_TOKENS)


def test_mixed_batch_only_the_biased_request_changes(llm, hf_model, tiny_llama_dir):
    prompts = [list(range(4, 30)), list(range(100, 117)), list(range(200, 240))]
    bias = {77: 12.5, 78: -3.0}
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logit_bias=bias),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS),
    ]
    outs = llm.generate(prompts, params)
    plain = hf_greedy_all(tiny_llama_dir, [prompts[0], prompts[2]], MAX_TOKENS)
    assert outs[0].token_ids == plain[0]
    assert outs[2].token_ids == plain[1]
    assert outs[1].token_ids == reference_greedy(hf_model, prompts[1], bias, MAX_TOKENS)
    assert 77 in outs[1].token_ids  # the bias did change this one


def test_token_ids_outside_the_vocabulary_are_refused(llm):
    vocab = llm.engine.vocab_size
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(["fine", "bad"], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, logit_bias={vocab: 1.0})])
    assert info.value.param == "logit_bias" and str(vocab) in info.value.message
    assert not llm.engine.has_unfinished()  # the good prompt of the rejected batch never started
    ok = llm.generate("x", SamplingParams(temperature=0.0, max_tokens=2, logit_bias={vocab - 1: 100.0}))[0]
    assert ok.token_ids == [vocab - 1] * 2


def test_allowed_token_ids_restrict_greedy_to_the_set(llm, hf_model):
    """vLLM's allowed_token_ids: greedy picks the model's best among the set, every step (the
    reference restricts transformers' logits by hand); other requests in the batch are untouched."""
    prompt = list(range(30, 52))
    allowed = [40, 41, 97, 150, 151]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = hf_model(torch.tensor([ids])).logits[0, -1]
            ids.append(max(allowed, key=lambda t: float(logits[t])))
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, allowed_token_ids=allowed),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)]
    outs = llm.generate([prompt, prompt], params)
    assert outs[0].token_ids == ids[len(prompt):]
    assert outs[1].token_ids == reference_greedy(hf_model, prompt, {}, MAX_TOKENS)
    sampled = llm.generate(prompt, SamplingParams(temperature=1.0, seed=4, max_tokens=8, allowed_token_ids=allowed))[0]
    assert set(sampled.token_ids) <= set(allowed)
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(prompt, SamplingParams(allowed_token_ids=[llm.engine.vocab_size]))
    assert info.value.param == "allowed_token_ids"


LETTERS_ONLY = {4 + b: 100.0 for b in range(ord("a"), ord("z") + 1)}  # byte tokenizer: id = 4 + byte


def _reference_without(model, prompt: list[int], banned: list[list[int]], steps: int) -> list[int]:
    """Greedy over transformers' logits (+ LETTERS_ONLY), each step banning the last token of
    every sequence in ``banned`` whose other tokens end the output so far (vLLM's bad_words)."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([prompt + out])).logits[0, -1].clone()
            for token, value in LETTERS_ONLY.items():
                logits[token] += value
            for ids in banned:
                if len(ids) == 1 or out[len(out) - len(ids) + 1 :] == ids[:-1]:
                    logits[ids[-1]] = float("-inf")
            out.append(int(logits.argmax()))
    return out


def test_bad_words_are_never_completed(llm, hf_model):
    prompt = list(range(60, 84))
    steps = 10
    plain = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=steps, logit_bias=LETTERS_ONLY))[0]
    text = plain.text
    assert len(text) == steps and text.isalpha()
    words = [text[2:4], text[5]]  # a two-letter word the model writes, and a one-letter one
    params = SamplingParams(temperature=0.0, max_tokens=steps, logit_bias=LETTERS_ONLY, bad_words=words)
    out = llm.generate(prompt, params)[0]
    assert all(w not in out.text for w in words)
    banned = [[4 + ord(ch) for ch in w] for w in words]  # " w" variants start with a space: never generated here
    assert out.token_ids == _reference_without(hf_model, prompt, banned, steps)
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(bad_words=["ok", " "])
    assert info.value.param == "bad_words"
