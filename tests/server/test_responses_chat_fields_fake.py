"""``POST /v1/responses`` and chat completions' own fields. Those /responses spells otherwise
(``messages``, ``max_tokens``, ``response_format`` ...) or does not serve (``n``, ``logprobs``)
change the output, so they are 400s naming the field with nothing started, never dropped; vLLM's
prompt-side fields mean what they mean on chat and reach the template and the prompt ids the
same way."""

from __future__ import annotations

import pytest

from tests.server.prompt_field_servers import serve_tenant
from tests.server.test_chat_template_fields_fake import PREFILL, USER, reference_ids

PATH = "/v1/responses"
UNSUPPORTED = "unsupported_parameter"


@pytest.fixture(scope="module")
def tenant(tmp_path_factory):
    yield from serve_tenant(tmp_path_factory, "initech", trust_request_chat_template=True)


@pytest.mark.parametrize("patch,param", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ({"max_tokens": 1}, "max_tokens"),
    ({"max_completion_tokens": 1}, "max_completion_tokens"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"guided_choice": ["a", "b"]}, "guided_choice"),
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
])
def test_chat_only_fields_are_refused_not_dropped(tenant, patch, param):
    err = tenant.refused(PATH, {"input": "hi", "max_output_tokens": 2, **patch}, param)
    assert err["code"] == UNSUPPORTED and f"`{param}`" in err["message"]


@pytest.mark.parametrize("patch", [{"n": 1}, {"logprobs": False}, {"max_tokens": None}, {"stream_options": None},
                                   {"response_format": {"type": "text"}}, {"structured_outputs": {}}])
def test_their_defaults_pass(tenant, patch):
    r = tenant.client.post(PATH, json={"model": "sql", "input": "hi", "max_output_tokens": 2, **patch})
    assert r.status_code == 200, r.text


def _ask(tenant, input_, **fields):
    r = tenant.client.post(PATH, json={"model": "sql", "input": input_, "max_output_tokens": 2, **fields})
    assert r.status_code == 200, r.text
    return tenant.last_prompt()


def test_prompt_fields_reach_the_prompt_as_on_chat(tenant):
    system, user = USER
    items = [{"role": "user", "content": user["content"]}]
    assert _ask(tenant, items, instructions=system["content"]) == reference_ids(USER)
    assert _ask(tenant, items, instructions=system["content"], add_generation_prompt=False) == reference_ids(
        USER, add_generation_prompt=False)
    prefill = items + [{"role": "assistant", "content": PREFILL[-1]["content"]}]
    assert _ask(tenant, prefill, instructions=system["content"], add_generation_prompt=False,
                continue_final_message=True) == reference_ids(PREFILL, add_generation_prompt=False,
                                                              continue_final_message=True)
    assert _ask(tenant, items, instructions=system["content"], add_special_tokens=True) == reference_ids(
        USER, add_special_tokens=True)
    assert _ask(tenant, items, instructions=system["content"], truncate_prompt_tokens=3) == reference_ids(USER)[-3:]
    template = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    assert _ask(tenant, items, chat_template=template) == reference_ids(items, chat_template=template)


@pytest.mark.parametrize("patch,param", [
    ({"add_generation_prompt": "no"}, "add_generation_prompt"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"documents": ["text"]}, "documents"),
    ({"chat_template": "{% for %}"}, "chat_template"),
])
def test_bad_prompt_fields_name_themselves(tenant, patch, param):
    tenant.refused(PATH, {"input": "hi", "max_output_tokens": 2, **patch}, param)


def test_a_reasoning_item_without_text_adds_no_turn():
    """OpenAI's reasoning items sent back carry only a summary or encrypted content: nothing to
    render, so no empty assistant turn appears between the user's (it did, changing the prompt)."""
    from loraplex.server.responses_protocol import parse_responses_request

    empty = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "thought"}],
             "encrypted_content": "gAAA"}
    items = [{"role": "user", "content": "a"}, empty, {"role": "user", "content": "b"}]
    req = parse_responses_request({"model": "m", "input": items})
    assert [(m["role"], m["content"]) for m in req.messages] == [("user", "a"), ("user", "b")]
    items = [{"role": "user", "content": "a"}, empty,
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]
    assert "reasoning" not in parse_responses_request({"model": "m", "input": items}).messages[1]


def test_vllms_request_id_is_the_responses_id(tenant):
    """vLLM names a response by its ``request_id`` field whole (it defaults to ``resp_...``),
    streamed or not; one no log should hold is a 400 naming it."""
    import json

    body = {"model": "sql", "input": "hi", "max_output_tokens": 2}
    r = tenant.client.post(PATH, json={**body, "request_id": "resp_job7"})
    assert r.status_code == 200 and r.json()["id"] == "resp_job7", r.text
    r = tenant.client.post(PATH, json={"model": "sql", "input": "hi", "max_output_tokens": 2, "request_id": "job8",
                                       "stream": True})
    events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data: {")]
    ids = {e["response"]["id"] for e in events if "response" in e}
    assert ids == {"job8"}
    plain = tenant.client.post(PATH, json={"model": "sql", "input": "hi", "max_output_tokens": 2}).json()["id"]
    assert plain.startswith("resp_") and plain != "resp_job7"
    tenant.refused(PATH, {"input": "hi", "max_output_tokens": 2, "request_id": "two words"}, "request_id")
