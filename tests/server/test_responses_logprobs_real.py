"""``include: ["message.output_text.logprobs"]`` with ``top_logprobs`` on ``/v1/responses``, on a
real (tiny, random Llama) engine through the openai client: the ``output_text`` part's logprobs
are chat completions' ``logprobs.content`` for the same conversation, entry for entry; their
values are transformers' log-softmax of the same tokens; a stream's
``response.output_text.delta`` events carry them in OpenAI's delta shape and join into the whole
answer's, and the done events carry the whole list. The openai client's pydantic types read
both answers."""

from __future__ import annotations

import pytest
import torch
from openai.types.chat import ChatCompletionTokenLogprob
from openai.types.responses import ResponseOutputText, ResponseTextDeltaEvent
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.server.real_tiny_server import start_tiny_server

INCLUDE = ["message.output_text.logprobs"]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say something"}]
N_TOKENS, TOP = 6, 3
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})  # ignore_eos: always N_TOKENS entries


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tiny = start_tiny_server(tmp_path_factory, seed=11)
    tok = AutoTokenizer.from_pretrained(tiny.folder)
    hf = AutoModelForCausalLM.from_pretrained(tiny.folder, dtype=torch.float32).eval()
    yield tiny.client, tiny.model, tok, hf
    tiny.stop()


def _same_entries(got: list[dict], want: list[dict]) -> bool:
    def shape(entries):  # the entries with each logprob rounded off
        return [{**e, "logprob": None, "top_logprobs": [{**t, "logprob": None} for t in e["top_logprobs"]]}
                for e in entries]

    def values(entries):
        return [v for e in entries for v in [e["logprob"], *(t["logprob"] for t in e["top_logprobs"])]]

    return shape(got) == shape(want) and values(got) == pytest.approx(values(want), abs=1e-5)


def _response(client, model, **kw):
    return client.responses.create(model=model, instructions="be brief", input="say something",
                                   max_output_tokens=N_TOKENS, include=INCLUDE, top_logprobs=TOP, **GREEDY, **kw)


def test_logprobs_are_chat_completions_and_transformers(world):
    client, model, tok, hf = world
    whole = _response(client, model)
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=N_TOKENS, logprobs=True,
                                          top_logprobs=TOP, **GREEDY)
    (item,) = whole.output
    (part,) = item.content
    assert isinstance(part, ResponseOutputText) and part.text == chat.choices[0].message.content
    chat_entries = chat.choices[0].logprobs.content
    assert len(chat_entries) == N_TOKENS and all(isinstance(e, ChatCompletionTokenLogprob) for e in chat_entries)
    # the same entries; values to float noise, as two runs of the same prompt may differ in their
    # last bits (the second reuses the first's cached prefix blocks)
    assert _same_entries([e.model_dump() for e in part.logprobs], [e.model_dump() for e in chat_entries])
    assert all(len(e.top_logprobs) == TOP for e in part.logprobs)
    assert whole.top_logprobs == TOP

    # transformers: the greedy tokens' log-softmax, and the TOP best values, at each position
    prompt = tok(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    assert whole.usage.input_tokens == len(prompt)
    with torch.no_grad():
        generated = hf.generate(torch.tensor([prompt]), max_new_tokens=N_TOKENS, min_new_tokens=N_TOKENS,
                                do_sample=False)[0, len(prompt):].tolist()
        ref = torch.log_softmax(hf(torch.tensor([prompt + generated])).logits[0].float(), dim=-1)
    for k, entry in enumerate(part.logprobs):
        logp = ref[len(prompt) + k - 1]
        assert entry.token == tok.decode([generated[k]])
        assert entry.logprob == pytest.approx(logp[generated[k]].item(), abs=2e-4)
        best = logp.topk(TOP).values.tolist()
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(best, abs=2e-4)


def test_streamed_deltas_carry_them_and_join_into_the_whole_answer(world):
    client, model, _, _ = world
    whole = _response(client, model)
    entries = [e.model_dump() for e in whole.output[0].content[0].logprobs]
    events = list(_response(client, model, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert all(isinstance(e, ResponseTextDeltaEvent) for e in deltas)
    assert "".join(e.delta for e in deltas) == whole.output_text
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    streamed = [lp.model_dump() for lp in done.logprobs]
    assert _same_entries(streamed, entries)  # another run of the same prompt: to float noise
    # OpenAI's delta shape: token, logprob, top_logprobs of token and logprob (no bytes, as vLLM),
    # the deltas' entries in order making the done event's
    joined = [lp.model_dump(exclude_none=True) for e in deltas for lp in e.logprobs]
    assert joined == [{"token": e["token"], "logprob": e["logprob"],
                       "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
                      for e in streamed]
    completed = events[-1]
    assert completed.type in ("response.completed", "response.incomplete")
    assert [lp.model_dump() for lp in completed.response.output[0].content[0].logprobs] == streamed


def test_no_logprobs_unless_included(world):
    client, model, _, _ = world
    plain = client.responses.create(model=model, input="say something", max_output_tokens=2, top_logprobs=TOP,
                                    **GREEDY)
    assert plain.output[0].content[0].logprobs == []
