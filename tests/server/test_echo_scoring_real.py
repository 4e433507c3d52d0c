"""Completions ``echo`` with ``max_tokens: 0`` on a real (tiny) engine, through the openai client:
the prompt and, with ``logprobs``, its tokens' logprobs, and no completion, as OpenAI's legacy
completions and vLLM (``echo_without_generation``) answer this prompt-scoring request. The
logprobs are checked against transformers' log-softmax over the same ids."""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.server.real_tiny_server import start_tiny_server

PROMPTS = ["the cat sat", "a dog"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tiny = start_tiny_server(tmp_path_factory, seed=3)
    yield tiny.client, tiny.model, tiny.folder, tiny.srv
    tiny.stop()


def _reference(folder, prompt: str) -> tuple[list[int], torch.Tensor]:
    """The prompt's ids and transformers' log-softmax after each of them: [len(ids), vocab]."""
    ids = AutoTokenizer.from_pretrained(folder)(prompt)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return ids, torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing(world):
    client, model, folder, srv = world
    # ignore_eos: the one token the engine runs is sampled, and an end-of-sequence token would
    # end it "stop" (vLLM answers the engine's finish reason; see the test below)
    kw = dict(model=model, prompt=PROMPTS, max_tokens=0, echo=True, logprobs=1, n=2, temperature=1.0,
              extra_body={"ignore_eos": True})
    out = client.completions.create(**kw)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for choice in out.choices:
        prompt = PROMPTS[choice.index // 2]
        ids, ref = _reference(folder, prompt)
        lp = choice.logprobs
        assert choice.text == prompt and choice.finish_reason == "length"
        assert len(lp.tokens) == len(lp.token_logprobs) == len(ids)  # the prompt's tokens, nothing after
        assert "".join(lp.tokens) == prompt and lp.token_logprobs[0] is None
        for pos in range(1, len(ids)):
            assert lp.token_logprobs[pos] == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=2e-4)
    # vLLM's usage: the engine's one step per choice counts as the completion
    prompt_tokens = sum(len(_reference(folder, p)[0]) for p in PROMPTS)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_tokens, 4)
    # streamed: each choice's prompt with its logprobs, then its finish reason, nothing else
    texts, logprobs, finishes = {}, {}, {}
    for chunk in client.completions.create(stream=True, **kw):
        (c,) = chunk.choices
        texts[c.index] = texts.get(c.index, "") + c.text
        if c.logprobs:
            logprobs.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
        if c.finish_reason:
            finishes.setdefault(c.index, []).append(c.finish_reason)
    assert texts == {c.index: c.text for c in out.choices}
    assert logprobs == {c.index: c.logprobs.token_logprobs for c in out.choices}
    assert finishes == {i: ["length"] for i in range(4)}
    # without logprobs: the prompt alone
    plain = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=0, echo=True)
    assert (plain.choices[0].text, plain.choices[0].logprobs) == (PROMPTS[0], None)
    streamed = [c.choices[0] for c in client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=0,
                                                                echo=True, stream=True)]
    assert "".join(c.text for c in streamed) == PROMPTS[0] and streamed[-1].finish_reason == "length"


def test_the_finish_is_the_engine_s_one_step_s_as_vllm_answers_it(world):
    """vLLM runs one token for ``echo`` with ``max_tokens: 0`` and answers that step's
    ``finish_reason`` and ``stop_reason``, not a fixed "length": a stop token it sampled is "stop"
    with the token's id. The token is transformers' greedy choice after the prompt."""
    client, model, folder, srv = world
    ids, ref = _reference(folder, PROMPTS[0])
    greedy = int(ref[-1].argmax())
    kw = dict(model=model, prompt=PROMPTS[0], max_tokens=0, echo=True, temperature=0.0)
    stopped = client.completions.create(**kw, extra_body={"stop_token_ids": [greedy]}).choices[0]
    assert (stopped.text, stopped.finish_reason, stopped.model_extra["stop_reason"]) == (PROMPTS[0], "stop", greedy)
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw,
                                                             extra_body={"stop_token_ids": [greedy]})]
    assert "".join(c.text for c in chunks) == PROMPTS[0]
    assert [(c.finish_reason, c.model_extra["stop_reason"]) for c in chunks if c.finish_reason] == [("stop", greedy)]
    other = client.completions.create(**kw, extra_body={"stop_token_ids": [greedy + 1]}).choices[0]
    assert (other.finish_reason, other.model_extra["stop_reason"]) == ("length", None)


def test_max_tokens_0_without_echo_is_still_refused(world):
    client, model, folder, srv = world
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="hi", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):  # chat has no echo
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=0)
