"""OpenAI compatibility, seen through the official ``openai`` client against a real ``loraplex
serve`` process (the shared server of compat_server.py; base model only): response and chunk
shapes, n > 1 in streams, usage chunks, finish reasons, logprobs objects (prompt logprobs
included), seeds, logit_bias, refused fields and the error classes the client raises.
Structured output and tool calls: test_openai_constraints_e2e.py."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.e2e.compat_server import client, model_dir, srv  # noqa: F401 (fixtures)
from tests.e2e.compat_server import LETTERS, MAX_CONCURRENT, MESSAGES, TOKEN_A, tenant_client
from tests.fixtures.tiny_models import EOS_ID

pytestmark = pytest.mark.slow


def test_non_stream_shapes(client):
    comp = client.completions.create(model="base-model", prompt="hi", max_tokens=5, n=2, temperature=1.0, seed=3,
                                     logit_bias=LETTERS)
    assert comp.id.startswith("cmpl-") and comp.object == "text_completion" and comp.model == "base-model"
    assert [c.index for c in comp.choices] == [0, 1]
    assert all(c.finish_reason == "length" and len(c.text) == 5 and c.logprobs is None for c in comp.choices)
    assert comp.choices[0].text != comp.choices[1].text  # each choice samples on its own
    assert (comp.usage.prompt_tokens, comp.usage.completion_tokens, comp.usage.total_tokens) == (2, 10, 12)  # one token per byte
    chat = client.chat.completions.create(model="base-model", messages=MESSAGES, max_completion_tokens=4,
                                          logit_bias=LETTERS)
    assert chat.id.startswith("chatcmpl-") and chat.object == "chat.completion"
    (choice,) = chat.choices
    assert choice.index == 0 and choice.message.role == "assistant" and len(choice.message.content) == 4
    assert choice.finish_reason == "length" and choice.logprobs is None
    assert chat.usage.completion_tokens == 4 and chat.usage.total_tokens == chat.usage.prompt_tokens + 4


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_stream_n2_choices_finish_and_usage(client, kind):
    common = dict(model="base-model", max_tokens=6, n=2, temperature=1.0, seed=11, logit_bias=LETTERS)
    if kind == "chat":
        whole = client.chat.completions.create(messages=MESSAGES, **common)
        stream = client.chat.completions.create(messages=MESSAGES, stream=True,
                                                stream_options={"include_usage": True}, **common)
        want = [c.message.content for c in whole.choices]
    else:
        whole = client.completions.create(prompt="stream me", **common)
        stream = client.completions.create(prompt="stream me", stream=True, stream_options={"include_usage": True},
                                           **common)
        want = [c.text for c in whole.choices]
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1
    *body, last = chunks
    assert last.choices == [] and last.usage.model_dump() == whole.usage.model_dump()
    texts, finishes, roles = ["", ""], [[], []], [0, 0]
    for chunk in body:
        assert chunk.usage is None and len(chunk.choices) == 1
        choice = chunk.choices[0]
        if kind == "chat":
            texts[choice.index] += choice.delta.content or ""
            roles[choice.index] += choice.delta.role == "assistant"
        else:
            texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finishes[choice.index].append(choice.finish_reason)
    assert texts == want and want[0] != want[1]
    assert finishes == [["length"], ["length"]]  # once per choice
    if kind == "chat":
        assert roles == [1, 1]  # each choice's first chunk announces the role
    # without stream_options, no usage anywhere
    plain = list(client.completions.create(model="base-model", prompt="x", max_tokens=2, stream=True))
    assert all(c.usage is None and len(c.choices) == 1 for c in plain)


def _finish(client, kind, stream=False, **kw):
    """(text, finish_reason, completion tokens) of one choice."""
    if kind == "chat":
        if stream:
            chunks = list(client.chat.completions.create(model="base-model", messages=MESSAGES, stream=True,
                                                         stream_options={"include_usage": True}, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            (finish,) = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            return text, finish, chunks[-1].usage.completion_tokens
        r = client.chat.completions.create(model="base-model", messages=MESSAGES, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
    if stream:
        chunks = list(client.completions.create(model="base-model", prompt="go", stream=True,
                                                stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        (finish,) = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return text, finish, chunks[-1].usage.completion_tokens
    r = client.completions.create(model="base-model", prompt="go", **kw)
    return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_finish_reasons(client, kind, stream):
    text, finish, used = _finish(client, kind, stream, max_tokens=7, temperature=0, logit_bias=LETTERS)
    assert (len(text), finish, used) == (7, "length", 7)
    stop = text[3:5]
    cut = text[: text.index(stop)]
    assert _finish(client, kind, stream, max_tokens=7, temperature=0, logit_bias=LETTERS, stop=[stop])[:2] == (cut, "stop")
    # EOS: "stop", and its text is no part of the output
    assert _finish(client, kind, stream, max_tokens=7, logit_bias={str(EOS_ID): 100}) == ("", "stop", 1)
    # a stop token id: "stop", its text left out (vLLM), unless include_stop_str_in_output
    pin_a = dict(max_tokens=7, logit_bias={str(TOKEN_A): 100})
    assert _finish(client, kind, stream, **pin_a, extra_body={"stop_token_ids": [TOKEN_A]}) == ("", "stop", 1)
    include = {"stop_token_ids": [TOKEN_A], "include_stop_str_in_output": True}
    assert _finish(client, kind, stream, **pin_a, extra_body=include) == ("a", "stop", 1)
    # min_tokens holds the stop token back (vLLM): three other tokens, then it
    text, finish, used = _finish(client, kind, stream, **pin_a, extra_body={**include, "min_tokens": 3})
    assert (finish, used) == ("stop", 4) and text.endswith("a") and not text.startswith("a")
    assert _finish(client, kind, stream, **pin_a) == ("a" * 7, "length", 7)


def test_chat_logprobs_shape(client):
    kw = dict(model="base-model", messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert isinstance(entry.token, str) and entry.logprob <= 0 and isinstance(entry.bytes, list)
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)  # greedy: the best one
        assert all(isinstance(t.bytes, list) for t in entry.top_logprobs)
    # bytes of the entries join into the text (a trailing partial character is never shown)
    joined = bytes(b for e in content for b in e.bytes).decode("utf-8", errors="replace")
    assert joined.startswith(r.choices[0].message.content)
    streamed = [e for c in client.chat.completions.create(stream=True, **kw) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    none = client.chat.completions.create(**{**kw, "top_logprobs": 0})
    assert all(e.top_logprobs == [] for e in none.choices[0].logprobs.content)
    off = client.chat.completions.create(model="base-model", messages=MESSAGES, max_tokens=2)
    assert off.choices[0].logprobs is None


def test_completion_logprobs_shape_and_echo(client):
    kw = dict(model="base-model", prompt="abc", max_tokens=6, temperature=0, logprobs=2, logit_bias=LETTERS)
    r = client.completions.create(**kw)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [0, 1, 2, 3, 4, 5]
    # the top 2 of the raw model plus, always, the sampled token (OpenAI: up to logprobs + 1)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 2 <= len(top) <= 3 and top[token] == logprob
    zero = client.completions.create(**{**kw, "logprobs": 0}).choices[0].logprobs
    assert zero.top_logprobs == [{t: p} for t, p in zip(zero.tokens, zero.token_logprobs)]
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw) if c.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset  # offsets run on across chunks
    echo = client.completions.create(model="base-model", prompt="abc", max_tokens=6, temperature=0, echo=True,
                                     logit_bias=LETTERS)
    assert echo.choices[0].text == "abc" + r.choices[0].text
    echoed = "".join(c.choices[0].text for c in client.completions.create(
        model="base-model", prompt="abc", max_tokens=6, temperature=0, echo=True, logit_bias=LETTERS, stream=True))
    assert echoed == echo.choices[0].text


def test_max_completion_tokens(client):
    r = client.chat.completions.create(model="base-model", messages=MESSAGES, max_completion_tokens=3,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(model="base-model", messages=MESSAGES, max_completion_tokens=2, max_tokens=9,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2  # the newer name wins


def test_seed_reproducible_inside_a_busy_batch(client):
    kw = dict(model="base-model", messages=MESSAGES, max_tokens=24, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True})
    alone = client.chat.completions.create(**kw).choices[0].message.content
    others = dict(model="base-model", prompt="noise", max_tokens=40, temperature=1.0,
                  extra_body={"ignore_eos": True})
    with ThreadPoolExecutor(3) as pool:
        noise = [pool.submit(client.completions.create, **others) for _ in range(2)]
        crowded = pool.submit(client.chat.completions.create, **kw)
        assert crowded.result().choices[0].message.content == alone
        [f.result() for f in noise]
    other_seed = client.chat.completions.create(**{**kw, "seed": 99}).choices[0].message.content
    assert other_seed != alone


def test_logit_bias_through_the_client(client):
    r = client.completions.create(model="base-model", prompt="x", max_tokens=4, logit_bias={str(TOKEN_A): 100})
    assert r.choices[0].text == "aaaa"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="base-model", messages=MESSAGES, logit_bias={"320": 1})  # vocab is 320
    assert info.value.body["param"] == "logit_bias" and info.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="base-model", prompt="x", logit_bias={"5": 101}, stream=True)
    assert info.value.body["param"] == "logit_bias"


@pytest.mark.parametrize(
    "extra,param",
    [({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
     ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, "tool_choice"),
     ({"extra_body": {"use_beam_search": True, "top_k": 5}}, "top_k")],
)
def test_refused_fields_raise_bad_request(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="base-model", messages=MESSAGES, max_tokens=2, **extra)
    assert info.value.body["param"] == param and info.value.body["code"] == "unsupported_parameter"
    ok = client.chat.completions.create(model="base-model", messages=MESSAGES, max_tokens=2,
                                        response_format={"type": "text"})
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_error_classes(srv, client):
    bad_key = openai.OpenAI(base_url=f"{srv.url}/t/compat/v1", api_key="lpx_wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad_key.completions.create(model="base-model", prompt="x", max_tokens=1)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-adapter", messages=MESSAGES)
    assert info.value.code == "model_not_found" and info.value.param == "model"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="base-model", prompt="x", temperature=7)
    assert info.value.param == "temperature" and info.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="base-model", prompt="x" * 600)
    assert info.value.code == "context_length_exceeded"


def test_rate_limit_error(srv):
    busy = tenant_client(srv, "busy")
    held = [busy.completions.create(model="base-model", prompt="hold", max_tokens=400, stream=True,
                                    extra_body={"ignore_eos": True}) for _ in range(MAX_CONCURRENT)]
    try:
        with pytest.raises(openai.RateLimitError) as info:
            busy.completions.create(model="base-model", prompt="x", max_tokens=1)
        assert info.value.status_code == 429 and info.value.code == "rate_limit_exceeded"
        assert info.value.response.headers.get("retry-after")
    finally:
        for stream in held:
            stream.close()
    # the slots come back once the streams are closed
    for _ in range(100):
        try:
            busy.completions.create(model="base-model", prompt="x", max_tokens=1)
            break
        except openai.RateLimitError:
            time.sleep(0.05)
    else:
        pytest.fail("tenant slots not released after the streams closed")


def test_models_list(srv, client):
    models = client.models.list()
    assert [m.id for m in models] == ["base-model"]
    (model,) = models.data
    assert model.object == "model" and isinstance(model.created, int) and model.owned_by
    raw = httpx.get(f"{srv.url}/t/compat/v1/models", headers={"Authorization": f"Bearer {client.api_key}"}).json()
    assert raw["object"] == "list"
    assert client.models.retrieve("base-model").model_dump(exclude={"created"}) == model.model_dump(exclude={"created"})
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-adapter")
    assert info.value.code == "model_not_found"


def _reference_logprobs(model_dir, ids: list[int]):
    """transformers' log-softmax after every position of ``ids``: [len(ids), vocab]."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_echo_with_logprobs_lists_the_prompt_tokens_first(client, model_dir):
    prompt = "the cat"
    ids = [4 + b for b in prompt.encode()]  # one token per byte
    ref = _reference_logprobs(model_dir, ids)
    kw = dict(model="base-model", prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=2)
    r = client.completions.create(**kw)
    lp = r.choices[0].logprobs
    n = len(ids)
    assert r.choices[0].text.startswith(prompt) and len(lp.tokens) == n + 1
    assert lp.tokens[:n] == list(prompt) and lp.text_offset == list(range(n + 1))
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    for pos in range(1, n):
        assert lp.token_logprobs[pos] == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=2e-4)
        # keyed by text: the top 2 (tokens of bytes >= 128 share the text U+FFFD, the higher
        # kept) and the prompt's own token
        top2 = ref[pos - 1].topk(2).values.tolist()
        values = sorted(lp.top_logprobs[pos].values(), reverse=True)
        assert values[0] == pytest.approx(top2[0], abs=2e-4)
        assert all(any(v == pytest.approx(w, abs=2e-4) for w in top2 + [lp.token_logprobs[pos]]) for v in values)
        assert lp.top_logprobs[pos][prompt[pos]] == lp.token_logprobs[pos]
    generated = int(ref[n - 1].argmax())  # greedy: the model's most likely next token
    assert lp.token_logprobs[n] == pytest.approx(float(ref[n - 1, generated]), abs=2e-4)
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw)]
    assert chunks[0].text == prompt and chunks[0].logprobs.tokens == list(prompt)
    streamed = [c.logprobs for c in chunks if c.logprobs]
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset


def test_vllm_prompt_logprobs_field(client, model_dir):
    prompt = "a dog"
    ids = [4 + b for b in prompt.encode()]
    ref = _reference_logprobs(model_dir, ids)
    r = client.completions.create(model="base-model", prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": 1})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for pos in range(1, len(ids)):
        row, token = ref[pos - 1], ids[pos]
        mine = got[pos][str(token)]
        assert mine["logprob"] == pytest.approx(float(row[token]), abs=2e-4)
        assert mine["rank"] == int((row > row[token]).sum()) + 1 and mine["decoded_token"] == prompt[pos]
        best = str(int(row.argmax()))
        assert got[pos][best]["rank"] == 1 and len(got[pos]) in (1, 2)
    chat = client.chat.completions.create(model="base-model", messages=MESSAGES, max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as info:  # as in vLLM: not with stream
        client.chat.completions.create(model="base-model", messages=MESSAGES, max_tokens=1, stream=True,
                                       extra_body={"prompt_logprobs": 0})
    assert info.value.body["param"] == "prompt_logprobs"


def test_beam_search_through_the_openai_client(client, model_dir):
    """vLLM's ``use_beam_search`` in ``extra_body``: n choices, the reference search's best beams
    (tests/engine/beam_reference.py over the transformers model), streamed in one piece each."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.engine.beam_reference import naive_vllm_beam_search

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok("hi")["input_ids"]
    expected = naive_vllm_beam_search(hf, ids, 3, 4, length_penalty=0.0, eos_ids=(EOS_ID,))
    texts = [tok.decode(gen[:-1] if eos else gen) for gen, _, eos in expected]
    extra = {"use_beam_search": True, "length_penalty": 0.0}
    comp = client.completions.create(model="base-model", prompt="hi", max_tokens=4, n=3, extra_body=extra)
    assert [c.index for c in comp.choices] == [0, 1, 2]
    assert [c.text for c in comp.choices] == texts
    assert comp.usage.prompt_tokens == len(ids)
    assert comp.usage.completion_tokens == sum(len(gen) - eos for gen, _, eos in expected)
    got = {}
    for chunk in client.completions.create(model="base-model", prompt="hi", max_tokens=4, n=3, extra_body=extra,
                                           stream=True):
        for c in chunk.choices:
            got[c.index] = got.get(c.index, "") + c.text
    assert [got[i] for i in range(3)] == texts
