"""The server the OpenAI-compatibility modules share (``compat_*`` fixtures in conftest.py): a
real ``loraplex serve`` over a tiny random Llama whose tokenizer has one token per byte (id = 4 +
byte, 1 = EOS), so ``logit_bias`` can pin the output to lowercase letters and make every check
exact. Its chat template is swapped for one that also shows tools and earlier tool calls
(``TOOLS_TEMPLATE``), which renders every conversation without them exactly as the fixture's
own template does."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.e2e.server_process import ServerProcess, start_server
from tests.fixtures.tiny_models import CHAT_TEMPLATE, make_tiny_model_dir

MAX_CONCURRENT = 4  # per tenant: the 429 test fills it
LETTERS = {str(4 + b): 100 for b in range(ord("a"), ord("z") + 1)}  # output only lowercase letters
TOKEN_A = 4 + ord("a")
MESSAGES = [{"role": "user", "content": "say something"}]


def make_tenant(srv: ServerProcess, name: str) -> str:
    with srv.admin() as c:
        assert c.post("/admin/v1/tenants", json={"name": name}).status_code == 201
        return c.post(f"/admin/v1/tenants/{name}/keys").json()["key"]


TOOLS_TEMPLATE = (
    "{% if tools %}<s>tools\n{% for tool in tools %}{{ tool['function']['name'] }}"
    "{{ tool['function']['parameters'] | tojson }}\n{% endfor %}</s>\n{% endif %}"
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}"
    "{% if message['tool_calls'] is defined %}{% for call in message['tool_calls'] %}"
    "<call>{{ call['function'] | tojson }}</call>{% endfor %}{% endif %}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def build_model_dir(root: Path) -> Path:
    from transformers import AutoTokenizer

    path = make_tiny_model_dir(root / "model", "llama", seed=7)
    (path / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(str(path))
    assert tok.chat_template == TOOLS_TEMPLATE
    convo = [{"role": "system", "content": "be brief"}, *MESSAGES, {"role": "assistant", "content": "ok"}]
    assert tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=True) == tok.apply_chat_template(
        convo, tokenize=False, add_generation_prompt=True, chat_template=CHAT_TEMPLATE)
    return path


def start_compat_server(root: Path, model_dir: Path) -> ServerProcess:
    return start_server(
        root / "home", model_dir, "--kv-cache-bytes", str(8 << 20), "--max-model-len", "512",
        "--max-concurrent-requests-per-tenant", str(MAX_CONCURRENT),
    )


def tenant_client(srv: ServerProcess, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/t/{tenant}/v1", api_key=make_tenant(srv, tenant), max_retries=0, timeout=60)


# short names for the conftest's session fixtures, imported by the two modules
@pytest.fixture
def model_dir(compat_model_dir):
    return compat_model_dir


@pytest.fixture
def srv(compat_srv):
    return compat_srv


@pytest.fixture
def client(compat_client):
    return compat_client
