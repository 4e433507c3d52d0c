"""A request's own chat template (``--trust-request-chat-template``) that runs away: Jinja's
sandbox does not bound time, recursion or size, and the template renders on the one tokenizer
thread every request's prompt waits for. Each is a 400 naming ``chat_template`` in seconds,
nothing left held, and the next request is served."""

from __future__ import annotations

import time

import pytest

from loraplex.server import template_guard
from tests.server.prompt_field_servers import MAX_MODEL_LEN, serve_tenant
from tests.server.test_chat_template_fields_fake import PATH, USER, ask, reference_ids

RUNAWAY = [
    # 10^10 iterations: hours
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    # a macro calling itself: the stack overflows (RecursionError)
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    # one multiplication: far more text than the context holds, for the tokenizer to chew on
    "{{ 'x' * 30000000 }}",
]


@pytest.fixture(scope="module")
def trusted(tmp_path_factory):
    yield from serve_tenant(tmp_path_factory, "hooli", trust_request_chat_template=True)


@pytest.mark.parametrize("template", RUNAWAY, ids=["loop", "recursion", "size"])
def test_runaway_request_templates_are_400s_and_the_server_goes_on(trusted, template, monkeypatch):
    monkeypatch.setattr(template_guard, "RENDER_SECONDS", 1.0)
    start = time.monotonic()
    err = trusted.refused(PATH, {"messages": USER, "chat_template": template}, "chat_template")
    assert time.monotonic() - start < 30 and "request's chat template" in err["message"]
    ask(trusted)  # the tokenizer thread is free again
    assert trusted.last_prompt() == reference_ids(USER)


def test_limits_leave_a_fair_template_alone(trusted):
    template = "{% for m in messages %}{% for i in range(3) %}{{ m['content'] }}{% endfor %}{% endfor %}"
    ask(trusted, chat_template=template)
    assert trusted.last_prompt() == reference_ids(USER, chat_template=template)


def test_the_deadline_and_the_size_cap():
    with pytest.raises(template_guard.TemplateLimitError, match="longer than 0.2 s"):
        template_guard.render_limited(lambda: [None for _ in iter(int, 1)], 16, seconds=0.2)
    assert template_guard.render_limited(lambda: "x" * 64, 1) == "x" * 64
    with pytest.raises(template_guard.TemplateLimitError, match="characters long"):
        template_guard.render_limited(lambda: "x" * 65, 1)
    assert MAX_MODEL_LEN * template_guard.MAX_CHARS_PER_TOKEN < 30000000
