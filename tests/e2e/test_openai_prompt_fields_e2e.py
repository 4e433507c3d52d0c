"""vLLM's prompt-side fields through the official ``openai`` client against a real ``loraplex
serve`` process (the shared compat server, greedy): a continued assistant message, a truncated
prompt, token-id logprobs and per-chunk usage, each against the same model answering the
reference prompt ids (transformers' tokenizer and chat template called directly) on
/completions. The HTTP layer's field-by-field checks: tests/server/test_*_fields_fake.py."""

from __future__ import annotations

import pytest

from tests.e2e.compat_server import client, model_dir  # noqa: F401 (fixtures)
from tests.e2e.compat_server import MESSAGES

pytestmark = pytest.mark.slow


def test_prompt_fields_match_the_reference_prompt(client, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    greedy = dict(model="base-model", max_tokens=5, temperature=0)
    convo = [*MESSAGES, {"role": "assistant", "content": "Sure, here"}]
    text = tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("Sure, here")  # the reference prompt: the prefill left open
    ids = tok(text, add_special_tokens=False)["input_ids"]
    as_ids = {"return_tokens_as_token_ids": True}
    chat = client.chat.completions.create(
        messages=convo, logprobs=True, **greedy,
        extra_body={"add_generation_prompt": False, "continue_final_message": True, **as_ids})
    same = client.completions.create(prompt=ids, logprobs=0, extra_body=as_ids, **greedy)
    assert chat.usage.prompt_tokens == len(ids) == same.usage.prompt_tokens
    assert chat.choices[0].message.content == same.choices[0].text
    tokens = [c.token for c in chat.choices[0].logprobs.content]
    assert tokens == same.choices[0].logprobs.tokens and all(t.startswith("token_id:") for t in tokens)
    assert len(tokens) == 5

    # truncate_prompt_tokens: the last 3 tokens of the prompt, as if sent alone
    prompt = "the cat sat"
    cut = client.completions.create(prompt=prompt, extra_body={"truncate_prompt_tokens": 3}, **greedy)
    alone = client.completions.create(prompt=tok(prompt)["input_ids"][-3:], **greedy)
    assert cut.usage.prompt_tokens == 3 and cut.choices[0].text == alone.choices[0].text

    # usage on every chunk, cumulative, the last chunk the whole request's
    chunks = list(client.chat.completions.create(
        messages=MESSAGES, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        **greedy))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 5
    counts = [c.usage.completion_tokens for c in body]
    assert counts[0] == 0 and counts[-1] == 5 and counts == sorted(counts)
    assert all(c.usage.prompt_tokens == last.usage.prompt_tokens for c in body)
