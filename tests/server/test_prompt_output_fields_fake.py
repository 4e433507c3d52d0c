"""vLLM's ``truncate_prompt_tokens``, completions' ``add_special_tokens``,
``return_tokens_as_token_ids`` and ``stream_options.continuous_usage_stats`` over the HTTP
layer (fake engine, real tiny tokenizer). References are computed here: the tokenizer called
directly (bytes are ids 4..259, BOS is id 0), the fake engine's tokens from ``fake_token``."""

from __future__ import annotations

import json

import pytest

from tests.fixtures.tiny_models import BOS_ID
from tests.server.fakes import VOCAB_OFFSET, fake_token
from tests.server.prompt_field_servers import MAX_MODEL_LEN, bos_tokenizer, serve_tenant

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def t(tmp_path_factory):
    yield from serve_tenant(tmp_path_factory, "acme")


def byte_ids(text: str) -> list[int]:
    return [4 + b for b in text.encode()]


def chat_ids(messages=USER) -> list[int]:
    tok = bos_tokenizer()
    return tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"]


def post(t, path, **body):
    r = t.client.post(path, json={"model": "sql", "max_tokens": 3, **body})
    assert r.status_code == 200, r.text
    return r


def events(r) -> list[dict]:
    return [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]


# --- truncate_prompt_tokens --------------------------------------------------------------------


def test_truncate_keeps_the_last_k_tokens(t):
    full = [BOS_ID, *byte_ids("hello world")]
    out = post(t, COMPLETIONS, prompt="hello world", truncate_prompt_tokens=4).json()
    assert t.last_prompt() == full[-4:] == byte_ids("orld")
    assert out["usage"]["prompt_tokens"] == 4  # what the model read, as vLLM reports it
    post(t, COMPLETIONS, prompt="hello world", truncate_prompt_tokens=len(full) + 5)  # shorter: kept whole
    assert t.last_prompt() == full
    post(t, COMPLETIONS, prompt="hello world", truncate_prompt_tokens=-1)  # -1: the context length
    assert t.last_prompt() == full
    post(t, COMPLETIONS, prompt=[5, 6, 7, 8, 9], truncate_prompt_tokens=2)  # token ids too
    assert t.last_prompt() == [8, 9]
    out = post(t, COMPLETIONS, prompt=["abcdef", "xy"], truncate_prompt_tokens=3).json()  # each prompt
    assert [t.srv.engine.prompts_seen[rid] for rid, _ in t.srv.engine.started[-2:]] == [byte_ids("def"),
                                                                                      [BOS_ID, *byte_ids("xy")]]
    assert out["usage"]["prompt_tokens"] == 6
    out = post(t, CHAT, messages=USER, truncate_prompt_tokens=5).json()
    assert t.last_prompt() == chat_ids()[-5:] and out["usage"]["prompt_tokens"] == 5
    r = post(t, CHAT, messages=USER, truncate_prompt_tokens=5, stream=True, stream_options={"include_usage": True})
    assert events(r)[-1]["usage"]["prompt_tokens"] == 5


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("k", [0, -2, MAX_MODEL_LEN + 1, "4", 2.5, True, [4]])
def test_truncate_refused(t, path, k):
    body = {"messages": USER} if path == CHAT else {"prompt": "hello"}
    err = t.refused(path, {**body, "truncate_prompt_tokens": k}, "truncate_prompt_tokens")
    if k == MAX_MODEL_LEN + 1:
        assert str(MAX_MODEL_LEN) in err["message"]


# --- add_special_tokens (completions) ----------------------------------------------------------


def test_completions_add_special_tokens(t):
    post(t, COMPLETIONS, prompt="hi you")
    assert t.last_prompt() == [BOS_ID, *byte_ids("hi you")]  # vLLM's default: true
    post(t, COMPLETIONS, prompt="hi you", add_special_tokens=False)
    assert t.last_prompt() == byte_ids("hi you")
    post(t, COMPLETIONS, prompt=[7, 8], add_special_tokens=True)  # token ids are taken as given
    assert t.last_prompt() == [7, 8]
    post(t, COMPLETIONS, prompt="hi you", add_special_tokens=0)  # 0 and 1 are booleans, as vLLM's pydantic takes them
    assert t.last_prompt() == byte_ids("hi you")
    t.refused(COMPLETIONS, {"prompt": "hi", "add_special_tokens": 2}, "add_special_tokens")


# --- return_tokens_as_token_ids ----------------------------------------------------------------


def _sampled(t, prompt_ids, n: int, seed=None) -> list[int]:
    return [fake_token(prompt_ids, t.sha, seed, 0, k) for k in range(n)]


def test_completion_logprob_tokens_as_ids(t):
    tok = bos_tokenizer()
    ids = _sampled(t, [BOS_ID, *byte_ids("ab")], 3, seed=4)
    out = post(t, COMPLETIONS, prompt="ab", logprobs=2, seed=4, return_tokens_as_token_ids=True).json()
    lp = out["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{i}" for i in ids]
    # the fake engine's alternatives: the sampled token and VOCAB_OFFSET
    assert lp["top_logprobs"] == [{f"token_id:{i}": -0.5, f"token_id:{VOCAB_OFFSET}": -1.5} if i != VOCAB_OFFSET
                                  else {f"token_id:{i}": -0.5} for i in ids]
    texts = [tok.decode([i]) for i in ids]
    assert out["choices"][0]["text"] == "".join(texts)
    assert lp["text_offset"] == [0, len(texts[0]), len(texts[0]) + len(texts[1])]  # offsets in the text
    # streamed: the same tokens and offsets, chunk by chunk
    r = post(t, COMPLETIONS, prompt="ab", logprobs=2, seed=4, stream=True, return_tokens_as_token_ids=True)
    chunks = [e["choices"][0]["logprobs"] for e in events(r) if e["choices"][0]["logprobs"]]
    assert {key: [v for c in chunks for v in c[key]] for key in lp} == lp
    # without the field: the tokens' text
    out = post(t, COMPLETIONS, prompt="ab", logprobs=1, seed=4).json()
    assert out["choices"][0]["logprobs"]["tokens"] == texts


def test_chat_logprob_tokens_as_ids(t):
    tok = bos_tokenizer()
    ids = _sampled(t, chat_ids(), 3, seed=2)
    body = {"messages": USER, "logprobs": True, "top_logprobs": 2, "seed": 2, "return_tokens_as_token_ids": True}
    content = post(t, CHAT, **body).json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{i}" for i in ids]
    assert [c["bytes"] for c in content] == [list(tok.decode([i]).encode()) for i in ids]  # the token's own bytes
    assert [[a["token"] for a in c["top_logprobs"]] for c in content] == [
        [f"token_id:{i}"] + ([f"token_id:{VOCAB_OFFSET}"] if i != VOCAB_OFFSET else []) for i in ids
    ]
    streamed = [c for e in events(post(t, CHAT, stream=True, **body))
                for c in ((e["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert streamed == content
    t.refused(CHAT, {"messages": USER, "return_tokens_as_token_ids": "yes"}, "return_tokens_as_token_ids")


# --- stream_options.continuous_usage_stats -----------------------------------------------------


def test_chat_usage_on_every_chunk(t):
    r = post(t, CHAT, messages=USER, n=2, stream=True,
             stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = events(r)
    prompt = len(chat_ids())
    per_choice: dict[int, list[int]] = {0: [], 1: []}
    for c in chunks[:-1]:
        assert c["usage"]["prompt_tokens"] == prompt
        assert c["usage"]["total_tokens"] == prompt + c["usage"]["completion_tokens"]
        per_choice[c["choices"][0]["index"]].append(c["usage"]["completion_tokens"])
    # cumulative, per choice: the role chunk 0, one token per content chunk, the finish chunk 3
    assert per_choice == {0: [0, 1, 2, 3, 3], 1: [0, 1, 2, 3, 3]}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": prompt, "completion_tokens": 6, "total_tokens": prompt + 6}
    # vLLM's include_usage defaults to true: continuous_usage_stats alone gives both
    alone = events(post(t, CHAT, messages=USER, stream=True, stream_options={"continuous_usage_stats": True}))
    assert [c["usage"]["completion_tokens"] for c in alone] == [0, 1, 2, 3, 3, 3]
    # and an explicit include_usage: false gives neither (vLLM)
    off = events(post(t, CHAT, messages=USER, stream=True,
                      stream_options={"include_usage": False, "continuous_usage_stats": True}))
    assert all("usage" not in c for c in off) and off[-1]["choices"]


def test_completion_usage_on_every_chunk_per_prompt(t):
    r = post(t, COMPLETIONS, prompt=["abcd", "x"], stream=True, max_tokens=2,
             stream_options={"continuous_usage_stats": True})
    chunks = events(r)
    seen = {0: [], 1: []}
    for c in chunks[:-1]:
        seen[c["choices"][0]["index"]].append((c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"]))
    assert seen == {0: [(5, 1), (5, 2)], 1: [(2, 1), (2, 2)]}  # each choice its own prompt's tokens
    assert chunks[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_continuous_usage_refused(t, path):
    body = {"messages": USER} if path == CHAT else {"prompt": "hello"}
    opts = {"stream_options": {"continuous_usage_stats": "yes"}}
    t.refused(path, {**body, **opts}, "stream_options.continuous_usage_stats")
    # stream_options without a stream: refused as include_usage is (vLLM refuses any)
    r = t.client.post(path, json={**body, "model": "sql", "stream_options": {"continuous_usage_stats": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
