"""Servers for the prompt-field tests: the fake engine over a real (tiny, byte-level) Hugging Face
tokenizer, so what the server hands the engine can be compared with transformers'
``apply_chat_template`` and tokenizer called directly."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from tests.fixtures.tiny_models import make_tiny_tokenizer
from tests.server.conftest import RunningServer, start_server
from tests.server.fakes import FakeEngine
from tests.server.test_errors_fake import _envelope

# the tiny ChatML-like template, plus a Qwen3-style switch: enable_thinking=false writes an
# empty thinking block after the generation prompt
THINKING_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
MAX_MODEL_LEN = 256


def bos_tokenizer(template: str = THINKING_TEMPLATE):
    """The tiny tokenizer with a BOS post-processor: ``add_special_tokens=True`` puts ``<s>``
    (id 0) first, as Llama's tokenizer does; ``template`` is its chat template."""
    from tokenizers import processors

    tok = make_tiny_tokenizer()
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.chat_template = template
    return tok


@dataclass
class Tenant:
    srv: RunningServer
    client: httpx.Client
    sha: str  # the adapter version's content hash

    def last_prompt(self) -> list[int]:
        return self.srv.engine.prompts_seen[self.srv.engine.started[-1][0]]

    def refused(self, path: str, body: dict, param: str) -> dict:
        """A 400 naming ``param``, for the adapter and the base model, streamed or not, that
        leaves nothing behind: no engine request, no adapter pin, no tenant slot."""
        started = len(self.srv.engine.started)
        err = None
        for model in ("sql", "fake-model"):
            for stream in (False, True):
                err = _envelope(self.client.post(path, json={**body, "model": model, "stream": stream}), 400,
                                param=param)
        assert len(self.srv.engine.started) == started
        assert self.srv.adapters.in_use.get(self.sha, 0) == 0
        ctx = self.srv.app.state.ctx
        assert ctx.limiter.in_flight() == 0 and ctx.lifecycle.in_flight == 0
        return err


def start_tenant(tmp_path, name: str, template: str = THINKING_TEMPLATE, **settings) -> Tenant:
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN)
    engine.tokenizer = bos_tokenizer(template)
    srv = start_server(tmp_path, engine, **settings)
    key = srv.make_tenant(name)
    sha = srv.upload(name, "sql", name.encode(), config=b"{}")["sha256"]
    return Tenant(srv, srv.tenant_client(key), sha)


def serve_tenant(tmp_path_factory, name: str, **kwargs):
    """For module fixtures (``yield from serve_tenant(...)``): ``start_tenant`` in a fresh
    directory, closed and stopped after the module."""
    tenant = start_tenant(tmp_path_factory.mktemp(name), name, **kwargs)
    try:
        yield tenant
    finally:
        tenant.client.close()
        tenant.srv.stop()
