"""vLLM's chat-template fields over the HTTP layer: ``chat_template_kwargs``,
``add_generation_prompt``, ``continue_final_message``, ``chat_template`` (only with
``--trust-request-chat-template``) and chat's ``add_special_tokens``. Each is checked against the
prompt ids the engine receives vs. transformers' ``apply_chat_template`` called directly with the
same arguments; each bad value is a 400 naming its field that leaves nothing behind."""

from __future__ import annotations

import pytest

from tests.fixtures.tiny_models import BOS_ID
from tests.server.prompt_field_servers import Tenant, bos_tokenizer, serve_tenant

PATH = "/v1/chat/completions"
USER = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is two and two"}]
PREFILL = [*USER, {"role": "assistant", "content": "The answer is"}]


@pytest.fixture(scope="module")
def trusted(tmp_path_factory):
    yield from serve_tenant(tmp_path_factory, "acme", trust_request_chat_template=True)


@pytest.fixture(scope="module")
def untrusted(tmp_path_factory):
    yield from serve_tenant(tmp_path_factory, "globex")


def reference_ids(messages, add_special_tokens=False, **template_args) -> list[int]:
    tok = bos_tokenizer()
    text = tok.apply_chat_template(messages, tokenize=False, **{"add_generation_prompt": True, **template_args})
    return tok(text, add_special_tokens=add_special_tokens)["input_ids"]


def ask(t: Tenant, messages=USER, **fields) -> dict:
    r = t.client.post(PATH, json={"model": "sql", "messages": messages, "max_tokens": 2, **fields})
    assert r.status_code == 200, r.text
    return r.json()


# --- chat_template_kwargs ---------------------------------------------------------------------


def test_chat_template_kwargs_reach_the_template(untrusted):
    ask(untrusted)
    default = untrusted.last_prompt()
    assert default == reference_ids(USER)
    out = ask(untrusted, chat_template_kwargs={"enable_thinking": False})
    assert untrusted.last_prompt() == reference_ids(USER, enable_thinking=False) != default
    assert bos_tokenizer().decode(untrusted.last_prompt()).endswith("<s>assistant\n<think>\n\n</think>\n\n")
    assert out["usage"]["prompt_tokens"] == len(untrusted.last_prompt())
    # a variable the template does not read changes nothing; an empty object is the default
    ask(untrusted, chat_template_kwargs={"enable_thinking": True, "unused": [1, {"a": None}]})
    assert untrusted.last_prompt() == default
    ask(untrusted, chat_template_kwargs={})
    assert untrusted.last_prompt() == default


@pytest.mark.parametrize("kwargs", [
    "enable_thinking", ["enable_thinking"], 5, True,
    # what loraplex passes the template itself (apply_chat_template's own parameters)
    {"messages": []}, {"conversation": []}, {"tools": [{"type": "function"}]}, {"documents": []},
    {"add_generation_prompt": False}, {"continue_final_message": True}, {"tokenize": True},
    {"chat_template": "{{ 'x' }}"}, {"return_dict": False}, {"enable_thinking": False, "truncation": True},
])
def test_chat_template_kwargs_refused(untrusted, kwargs):
    err = untrusted.refused(PATH, {"messages": USER, "chat_template_kwargs": kwargs}, "chat_template_kwargs")
    if isinstance(kwargs, dict):
        name = next(k for k in kwargs if k != "enable_thinking")
        assert repr(name) in err["message"]


# --- add_generation_prompt, continue_final_message --------------------------------------------


def test_add_generation_prompt_false(untrusted):
    ask(untrusted, add_generation_prompt=False)
    assert untrusted.last_prompt() == reference_ids(USER, add_generation_prompt=False)
    assert bos_tokenizer().decode(untrusted.last_prompt()).endswith("what is two and two</s>\n")
    ask(untrusted, add_generation_prompt=True, continue_final_message=False)
    assert untrusted.last_prompt() == reference_ids(USER)


def test_continue_final_message_leaves_the_last_turn_open(untrusted):
    out = ask(untrusted, PREFILL, add_generation_prompt=False, continue_final_message=True)
    want = reference_ids(PREFILL, add_generation_prompt=False, continue_final_message=True)
    assert untrusted.last_prompt() == want
    # by hand: the conversation up to the prefill, with no end of turn after it
    assert bos_tokenizer().decode(want) == (
        "<s>system\nbe brief</s>\n<s>user\nwhat is two and two</s>\n<s>assistant\nThe answer is"
    )
    assert out["usage"]["prompt_tokens"] == len(want)
    # streamed: the same prompt
    r = untrusted.client.post(PATH, json={"model": "sql", "messages": PREFILL, "max_tokens": 2, "stream": True,
                                          "add_generation_prompt": False, "continue_final_message": True})
    assert r.status_code == 200 and untrusted.last_prompt() == want


@pytest.mark.parametrize("fields,messages,param", [
    # vLLM refuses the pair; add_generation_prompt defaults to true there too
    ({"continue_final_message": True}, PREFILL, "continue_final_message"),
    ({"continue_final_message": True, "add_generation_prompt": True}, PREFILL, "continue_final_message"),
    ({"continue_final_message": True, "add_generation_prompt": False}, USER, "continue_final_message"),
    ({"continue_final_message": "yes", "add_generation_prompt": False}, PREFILL, "continue_final_message"),
    ({"add_generation_prompt": 2}, USER, "add_generation_prompt"),  # 0 and 1 are booleans, as in vLLM
    ({"add_generation_prompt": "false"}, USER, "add_generation_prompt"),
])
def test_generation_prompt_fields_refused(untrusted, fields, messages, param):
    untrusted.refused(PATH, {"messages": messages, **fields}, param)


# --- chat_template ----------------------------------------------------------------------------

REQUEST_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}{% if flavour %} ({{ flavour }}){% endif %}"
)


def test_request_template_needs_the_servers_trust(untrusted):
    err = untrusted.refused(PATH, {"messages": USER, "chat_template": REQUEST_TEMPLATE}, "chat_template")
    assert "--trust-request-chat-template" in err["message"]


def test_request_template_renders_when_trusted(trusted):
    ask(trusted, chat_template=REQUEST_TEMPLATE)
    want = reference_ids(USER, chat_template=REQUEST_TEMPLATE)
    assert trusted.last_prompt() == want
    assert bos_tokenizer().decode(want) == "[SYSTEM] be brief\n[USER] what is two and two\n[ASSISTANT]"
    # with the kwargs and the generation-prompt fields
    ask(trusted, chat_template=REQUEST_TEMPLATE, chat_template_kwargs={"flavour": "dry"}, add_generation_prompt=False)
    assert trusted.last_prompt() == reference_ids(USER, chat_template=REQUEST_TEMPLATE, flavour="dry",
                                                  add_generation_prompt=False)
    assert bos_tokenizer().decode(trusted.last_prompt()).endswith("two and two\n (dry)")
    ask(trusted)  # the model's own template again
    assert trusted.last_prompt() == reference_ids(USER)


@pytest.mark.parametrize("template", [
    "{% for m in messages %}",  # does not compile
    "{{ raise_exception('no system messages') }}",  # the template refuses
    "{{ messages.append({'role': 'user'}) }}",  # the sandbox refuses: templates cannot mutate
    "{{ messages[0].content.__class__.__mro__[1].__subclasses__() }}",  # nor reach Python's internals
    "", "   ", 5, ["{{ x }}"],
])
def test_bad_request_templates_refused(trusted, template):
    trusted.refused(PATH, {"messages": USER, "chat_template": template}, "chat_template")


# --- add_special_tokens -----------------------------------------------------------------------


def test_add_special_tokens_adds_bos_on_top_of_the_template(untrusted):
    ask(untrusted, add_special_tokens=True)
    want = reference_ids(USER, add_special_tokens=True)
    assert want[0] == BOS_ID and want[1:] == reference_ids(USER)  # BOS, then the template's own <s>...
    assert untrusted.last_prompt() == want
    ask(untrusted, add_special_tokens=False)  # vLLM's chat default
    assert untrusted.last_prompt() == reference_ids(USER)
    untrusted.refused(PATH, {"messages": USER, "add_special_tokens": "true"}, "add_special_tokens")
