"""The Responses API through a real ``loraplex serve`` (the shared compatibility server, a tiny
random Llama, base model only), read by the openai client: a greedy ``responses.create`` answers
the same text and usage as chat completions for the same conversation, and the streamed deltas
join into it. The shapes in detail, over fake engines: tests/server/test_responses_fake.py."""

from __future__ import annotations

import pytest

from tests.e2e.compat_server import client  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow


def test_greedy_text_equals_chat_completions(client):
    # logit_bias is not a Responses field: greedy on the raw model may write any byte, which the
    # comparison does not mind
    whole = client.responses.create(model="base-model", instructions="be brief", input="say something",
                                    max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(model="base-model", max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "say something"}])
    choice = chat.choices[0]
    assert whole.output_text == choice.message.content and whole.output_text  # the random model writes bytes
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                      chat.usage.completion_tokens)
    assert whole.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    deltas = [e.delta for e in client.responses.create(model="base-model", instructions="be brief",
                                                       input="say something", max_output_tokens=8, temperature=0,
                                                       stream=True)
              if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text
