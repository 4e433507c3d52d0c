"""vLLM's ``--chat-template``: the server's template (a file, or the Jinja itself) replaces the
tokenizer's for every chat request and /tokenize, a model without a template can then chat, and
a flag that is neither a file nor a compiling template stops the server at start. Plus the vLLM
flags that ask for nothing loraplex does otherwise."""

from __future__ import annotations

import pytest

from loraplex.config import Settings
from loraplex.server.app import create_app
from loraplex.server.chat_template import load_chat_template
from tests.fixtures.tiny_models import make_tiny_tokenizer
from tests.server.conftest import start_server
from tests.server.fakes import FakeEngine
from tests.server.test_vllm_flags import settings

SERVER_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


def test_load_from_a_file_or_inline(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(SERVER_TEMPLATE)
    assert load_chat_template(str(path)) == SERVER_TEMPLATE
    assert load_chat_template(SERVER_TEMPLATE) == SERVER_TEMPLATE
    single_line = SERVER_TEMPLATE.replace("\n", "\\n")  # vLLM's single-line form
    assert load_chat_template(single_line) == SERVER_TEMPLATE
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not compile"):
        load_chat_template("{% for m in messages %}{{ m }}")


def test_inline_template_keeps_text_past_ascii():
    """The single-line form with any escape decoded "é" as "Ã©" and "✓" as three Latin-1
    characters (vLLM's ``codecs.decode(value, "unicode_escape")`` does the same); a lone
    backslash at the end was a raw codec error rather than the flag's."""
    assert load_chat_template('{{ "é ✓ 😀" }}\\n{{ "\\u00e9" }}') == '{{ "é ✓ 😀" }}\n{{ "é" }}'
    with pytest.raises(ValueError, match="^--chat-template: a backslash escape"):
        load_chat_template("{{ x }}\\")


def test_a_bad_template_stops_the_server_at_start(tmp_path):
    with pytest.raises(ValueError, match="does not compile"):
        create_app(Settings(home=tmp_path, chat_template="{{ messages"))


@pytest.mark.parametrize("model_has_template", [True, False])
def test_the_server_template_is_what_chat_and_tokenize_render(tmp_path, model_has_template):
    engine = FakeEngine()
    engine.tokenizer = make_tiny_tokenizer()
    if not model_has_template:
        engine.tokenizer.chat_template = None
    path = tmp_path / "t.jinja"
    path.write_text(SERVER_TEMPLATE)
    srv = start_server(tmp_path / "srv", engine, chat_template=str(path))
    try:
        key = srv.make_tenant("acme")
        expected = make_tiny_tokenizer().apply_chat_template(
            MESSAGES, chat_template=SERVER_TEMPLATE, add_generation_prompt=True, tokenize=True, return_dict=False)
        model = srv.app.state.ctx.served_model_name
        with srv.tenant_client(key) as c:
            r = c.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES, "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert engine.prompts_seen[engine.started[-1][0]] == list(expected)
            tokens = c.post("/tokenize", json={"model": model, "messages": MESSAGES}).json()["tokens"]
        assert tokens == list(expected)
    finally:
        srv.stop()


def test_vllm_flags_that_ask_for_nothing_else():
    s = settings("m", "--trust-remote-code", "--disable-log-requests", "--disable-log-stats", "--enable-request-id-headers",
                 "--max-num-batched-tokens", "8k", "--chat-template", "{{ messages }}")
    assert s.model == "m" and s.max_num_batched_tokens == 8000 and s.chat_template == "{{ messages }}"
