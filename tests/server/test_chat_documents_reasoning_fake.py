"""Two chat inputs that reach the template besides the messages' text: vLLM's ``documents`` (RAG
templates such as Command-R's render them) and an earlier assistant turn's ``reasoning`` /
``reasoning_content`` (Qwen3's template renders it). Checked against the prompt ids the engine
receives vs. transformers' ``apply_chat_template`` called directly; each bad value is a 400 naming
its field that leaves nothing behind; ``/tokenize`` counts what chat completions run."""

from __future__ import annotations

import pytest

from tests.server.prompt_field_servers import bos_tokenizer, serve_tenant

PATH = "/v1/chat/completions"

# the tiny ChatML-like template, plus documents before the conversation (a header even for an
# empty list, so [] and none differ) and an assistant turn's reasoning_content in <think> tags
RAG_TEMPLATE = (
    "{% if documents is not none %}<s>documents\n{% for doc in documents %}"
    "{% if doc.text is not defined %}{{ raise_exception('every document needs a text') }}{% endif %}"
    "[{{ loop.index0 }}]{% for key, value in doc.items() %} {{ key }}={{ value }}{% endfor %}{{ '\\n' }}"
    "{% endfor %}</s>\n{% endif %}"
    "{% for message in messages %}<s>{{ message['role'] }}\n"
    "{% if message.reasoning_content is string %}<think>{{ message.reasoning_content }}</think>{% endif %}"
    "{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
DOCS = [
    {"title": "Tides", "text": "Two high tides a day."},
    {"text": "The moon pulls the sea.", "source": "almanac ✓"},
]
QUESTION = {"role": "user", "content": "why tides?"}


@pytest.fixture(scope="module")
def rag(tmp_path_factory):
    yield from serve_tenant(tmp_path_factory, "initech", template=RAG_TEMPLATE)


def reference_ids(messages, **template_args) -> list[int]:
    tok = bos_tokenizer(RAG_TEMPLATE)
    text = tok.apply_chat_template(messages, tokenize=False, **{"add_generation_prompt": True, **template_args})
    return tok(text, add_special_tokens=False)["input_ids"]


def decode(ids) -> str:
    return bos_tokenizer(RAG_TEMPLATE).decode(ids)


def ask(t, messages, **fields) -> dict:
    r = t.client.post(PATH, json={"model": "sql", "messages": messages, "max_tokens": 2, **fields})
    assert r.status_code == 200, r.text
    return r.json()


# --- documents --------------------------------------------------------------------------------


def test_documents_reach_the_template(rag):
    out = ask(rag, [QUESTION], documents=DOCS)
    want = reference_ids([QUESTION], documents=DOCS)
    assert rag.last_prompt() == want and out["usage"]["prompt_tokens"] == len(want)
    assert decode(want) == (
        "<s>documents\n[0] title=Tides text=Two high tides a day.\n"
        "[1] text=The moon pulls the sea. source=almanac ✓\n</s>\n"
        "<s>user\nwhy tides?</s>\n<s>assistant\n"
    )
    # streamed: the same prompt
    r = rag.client.post(PATH, json={"model": "fake-model", "messages": [QUESTION], "documents": DOCS,
                                    "stream": True, "max_tokens": 2})
    assert r.status_code == 200 and rag.last_prompt() == want


def test_no_documents_null_and_empty(rag):
    ask(rag, [QUESTION])
    assert rag.last_prompt() == reference_ids([QUESTION]) == reference_ids([QUESTION], documents=None)
    ask(rag, [QUESTION], documents=None)
    assert rag.last_prompt() == reference_ids([QUESTION])
    # an empty list is passed on as one (vLLM does), which this template tells from none
    ask(rag, [QUESTION], documents=[])
    assert rag.last_prompt() == reference_ids([QUESTION], documents=[]) != reference_ids([QUESTION])
    # documents of any string keys, an empty object too (vLLM's type is list[dict[str, str]])
    docs = [{"text": ""}, {"text": "x", "url": "https://example.com"}]
    ask(rag, [QUESTION], documents=docs)
    assert rag.last_prompt() == reference_ids([QUESTION], documents=docs)


@pytest.mark.parametrize("documents", [
    "Two high tides a day.", {"title": "Tides", "text": "x"}, 5, True,
    ["Two high tides a day."], [DOCS[0], None], [[DOCS[0]]],
    [{"title": "Tides", "text": 2}], [{"text": None}], [{"text": "x", "meta": {"page": 1}}], [{"text": ["a"]}],
    [{"title": "no text"}],  # the model's template refuses it: the messages render without documents
])
def test_bad_documents_refused(rag, documents):
    rag.refused(PATH, {"messages": [QUESTION], "documents": documents}, "documents")


def test_documents_with_the_other_template_fields(rag):
    prefill = [QUESTION, {"role": "assistant", "content": "Because"}]
    ask(rag, prefill, documents=DOCS, add_generation_prompt=False, continue_final_message=True)
    want = reference_ids(prefill, documents=DOCS, add_generation_prompt=False, continue_final_message=True)
    assert rag.last_prompt() == want and decode(want).endswith("<s>assistant\nBecause")


# --- an earlier turn's reasoning --------------------------------------------------------------

ANSWER = "The moon."
THOUGHT = "\nTides come from gravity.\n"
AS_TEMPLATED = [QUESTION, {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT},
                {"role": "user", "content": "and twice?"}]


@pytest.mark.parametrize("sent", [
    {"reasoning_content": THOUGHT},
    {"reasoning": THOUGHT},  # vLLM's newer name: the template still reads reasoning_content
    {"reasoning": THOUGHT, "reasoning_content": THOUGHT},  # a loraplex answer sent back whole
])
def test_reasoning_of_an_earlier_turn_reaches_the_template(rag, sent):
    messages = [QUESTION, {"role": "assistant", "content": ANSWER, **sent}, AS_TEMPLATED[2]]
    out = ask(rag, messages)
    want = reference_ids(AS_TEMPLATED)
    assert rag.last_prompt() == want and out["usage"]["prompt_tokens"] == len(want)
    assert "<s>assistant\n<think>\nTides come from gravity.\n</think>The moon.</s>\n" in decode(want)


def test_without_reasoning_nothing_is_rendered(rag):
    plain = [QUESTION, {"role": "assistant", "content": ANSWER}, AS_TEMPLATED[2]]
    for extra in ({}, {"reasoning": None, "reasoning_content": None}):
        ask(rag, [QUESTION, {**plain[1], **extra}, plain[2]])
        assert rag.last_prompt() == reference_ids(plain) != reference_ids(AS_TEMPLATED)
    # an empty reasoning is still a reasoning (vLLM passes any string on)
    ask(rag, [QUESTION, {**plain[1], "reasoning": ""}, plain[2]])
    assert rag.last_prompt() == reference_ids([QUESTION, {**plain[1], "reasoning_content": ""}, plain[2]])
    # on other roles it is not kept, as in vLLM: no template reads a user's reasoning
    ask(rag, [{**QUESTION, "reasoning_content": "mine"}])
    assert rag.last_prompt() == reference_ids([QUESTION])


def test_a_turn_of_only_reasoning_or_tool_calls_may_have_null_content(rag):
    # what the server answers when the output ended inside the reasoning (content null)
    ask(rag, [QUESTION, {"role": "assistant", "content": None, "reasoning": THOUGHT}, AS_TEMPLATED[2]])
    want = reference_ids([QUESTION, {"role": "assistant", "content": "", "reasoning_content": THOUGHT},
                          AS_TEMPLATED[2]])
    assert rag.last_prompt() == want
    call = {"id": "call_1", "type": "function", "function": {"name": "moon", "arguments": "{}"}}
    ask(rag, [QUESTION, {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": THOUGHT},
              {"role": "tool", "tool_call_id": "call_1", "content": "near"}])
    templated_call = {**call, "function": {"name": "moon", "arguments": {}}}  # arguments as an object (vLLM)
    assert rag.last_prompt() == reference_ids([
        QUESTION, {"role": "assistant", "content": "", "tool_calls": [templated_call], "reasoning_content": THOUGHT},
        {"role": "tool", "tool_call_id": "call_1", "content": "near"}])
    assert "<s>assistant\n<think>\nTides come from gravity.\n</think></s>\n" in decode(rag.last_prompt())


@pytest.mark.parametrize("extra,param", [
    ({"reasoning_content": 5}, "messages[1].reasoning_content"),
    ({"reasoning_content": ["a"]}, "messages[1].reasoning_content"),
    ({"reasoning": {"text": "a"}}, "messages[1].reasoning"),
    ({"reasoning": False}, "messages[1].reasoning"),
    # two names for one text, with two texts: refused rather than one of them lost
    ({"reasoning": "one", "reasoning_content": "two"}, "messages[1].reasoning_content"),
])
def test_bad_reasoning_refused(rag, extra, param):
    messages = [QUESTION, {"role": "assistant", "content": ANSWER, **extra}, AS_TEMPLATED[2]]
    rag.refused(PATH, {"messages": messages}, param)


def test_null_content_still_needs_reasoning_or_tool_calls(rag):
    messages = [QUESTION, {"role": "assistant", "content": None}, AS_TEMPLATED[2]]
    rag.refused(PATH, {"messages": messages}, "messages[1].content")


# --- /tokenize --------------------------------------------------------------------------------


def test_tokenize_counts_what_chat_completions_run(rag):
    messages = [QUESTION, {"role": "assistant", "content": None, "reasoning": THOUGHT}, AS_TEMPLATED[2]]
    body = {"messages": messages, "documents": DOCS}
    r = rag.client.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    out = ask(rag, **body)
    assert r.json()["tokens"] == rag.last_prompt() and r.json()["count"] == out["usage"]["prompt_tokens"]
    assert r.json()["tokens"] == reference_ids(
        [QUESTION, {"role": "assistant", "content": "", "reasoning_content": THOUGHT}, AS_TEMPLATED[2]],
        documents=DOCS)


@pytest.mark.parametrize("body,param", [
    ({"messages": [QUESTION], "documents": "x"}, "documents"),
    ({"messages": [QUESTION], "documents": [{"title": "no text"}]}, "documents"),
    ({"messages": [QUESTION, {"role": "assistant", "content": "a", "reasoning": 1}]}, "messages[1].reasoning"),
])
def test_tokenize_refuses_what_chat_completions_refuse(rag, body, param):
    started = len(rag.srv.engine.started)
    r = rag.client.post("/tokenize", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert len(rag.srv.engine.started) == started
