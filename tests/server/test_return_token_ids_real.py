"""vLLM's ``return_token_ids`` on a real (tiny) engine, through the openai client (the fields
come back in ``model_extra``): prompt ids as the tokenizer / chat template make them, generated
ids as transformers' greedy search picks them, streamed ids joining into the whole answer's,
text held back by a stop string included."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.server.real_tiny_server import start_tiny_server

MESSAGES = [{"role": "user", "content": "say something"}]
GREEDY = dict(max_tokens=6, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tiny = start_tiny_server(tmp_path_factory, seed=5)
    tok = AutoTokenizer.from_pretrained(tiny.folder)
    hf = AutoModelForCausalLM.from_pretrained(tiny.folder, dtype=torch.float32).eval()
    yield tiny.client, tiny.model, tok, hf
    tiny.stop()


def _greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_completions_return_prompt_and_generated_ids(world):
    client, model, tok, hf = world
    prompts = ["the cat", "a dog ran"]
    out = client.completions.create(model=model, prompt=prompts, n=2, **GREEDY)
    for choice in out.choices:
        ids = tok(prompts[choice.index // 2])["input_ids"]
        extra = choice.model_extra
        assert extra["prompt_token_ids"] == ids
        assert extra["token_ids"] == _greedy(hf, ids, 6)
        assert tok.decode(extra["token_ids"]).startswith(choice.text)  # a trailing partial character is not shown
    streamed: dict[int, dict] = {}
    for chunk in client.completions.create(model=model, prompt=prompts, n=2, stream=True, **GREEDY):
        (c,) = chunk.choices
        got = streamed.setdefault(c.index, {"prompt": [], "ids": []})
        if c.model_extra.get("prompt_token_ids") is not None:
            got["prompt"].append(c.model_extra["prompt_token_ids"])
        got["ids"] += c.model_extra["token_ids"]
    for choice in out.choices:  # the prompt once, on the first chunk; the ids join into the answer's
        assert streamed[choice.index] == {"prompt": [choice.model_extra["prompt_token_ids"]],
                                          "ids": choice.model_extra["token_ids"]}
    plain = client.completions.create(model=model, prompt="x", max_tokens=2)
    assert "token_ids" not in plain.choices[0].model_extra  # only when asked


def test_chat_returns_prompt_ids_at_the_top_and_ids_per_choice(world):
    client, model, tok, hf = world
    ids = tok(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]  # the template writes the special tokens (vLLM's default)
    out = client.chat.completions.create(model=model, messages=MESSAGES, **GREEDY)
    assert out.model_extra["prompt_token_ids"] == ids and out.usage.prompt_tokens == len(ids)
    assert out.choices[0].model_extra["token_ids"] == _greedy(hf, ids, 6)
    # a stop string holds text back: its ids still come, on a later chunk (vLLM's token_ids keep the
    # stop string's tokens, as the usage counts them)
    text = out.choices[0].message.content
    stop = text[2:4]
    whole = client.chat.completions.create(model=model, messages=MESSAGES, stop=[stop], **GREEDY)
    assert whole.choices[0].finish_reason == "stop"
    prompts, got = [], []
    for chunk in client.chat.completions.create(model=model, messages=MESSAGES, stop=[stop], stream=True, **GREEDY):
        if chunk.model_extra.get("prompt_token_ids") is not None:
            prompts.append(chunk.model_extra["prompt_token_ids"])
        got += chunk.choices[0].model_extra["token_ids"] or []
    assert prompts == [ids] and got == whole.choices[0].model_extra["token_ids"]
    assert len(got) == whole.usage.completion_tokens
