"""Prompts are rendered, tokenized and decoded on the app's tokenizer thread, never on the event
loop: while one request's (long) prompt is being tokenized, the server keeps answering and
streaming to everyone else. The fake engine carries the tests' real tokenizer behind a proxy that
records the calling thread and can hold one marked prompt until released."""

from __future__ import annotations

import sys
import threading

import httpx
import pytest

from tests.fixtures.tiny_models import make_tiny_tokenizer
from tests.server.conftest import start_server
from tests.server.fakes import FakeEngine

HOLD = "hold this prompt"


class RecordingTokenizer:
    """The tiny tokenizer, recording which thread calls it; a text containing ``HOLD`` blocks
    in ``__call__`` until ``release`` is set."""

    def __init__(self):
        self.inner = make_tiny_tokenizer()
        self.threads: set[str] = set()
        self.holding = threading.Event()
        self.release = threading.Event()

    def _note(self) -> None:
        # the fake engine's own decoding stands for the engine thread's detokenizer, not the server's
        if "fakes.py" not in sys._getframe(2).f_code.co_filename:
            self.threads.add(threading.current_thread().name)

    def __call__(self, text, *args, **kwargs):
        self._note()
        if isinstance(text, str) and HOLD in text:
            self.holding.set()
            assert self.release.wait(20)
        return self.inner(text, *args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self._note()
        return self.inner.apply_chat_template(*args, **kwargs)

    def decode(self, *args, **kwargs):
        self._note()
        return self.inner.decode(*args, **kwargs)

    def convert_ids_to_tokens(self, *args, **kwargs):
        self._note()
        return self.inner.convert_ids_to_tokens(*args, **kwargs)

    def __len__(self):
        return len(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture
def world(tmp_path):
    engine = FakeEngine()
    tok = engine.tokenizer = RecordingTokenizer()
    srv = start_server(tmp_path, engine)
    key = srv.make_tenant("tt")
    yield srv, key, tok
    tok.release.set()
    srv.stop()


def test_every_route_tokenizes_on_the_tokenizer_thread(world):
    srv, key, tok = world
    model = srv.app.state.ctx.served_model_name
    with srv.tenant_client(key) as c:
        assert c.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 2}).status_code == 200
        assert c.post("/v1/chat/completions", json={"model": model, "max_tokens": 2,
                                                    "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
        assert c.post("/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 2}}).status_code == 200
        assert c.post("/tokenize", json={"model": model, "prompt": "hello"}).status_code == 200
        assert c.post("/tokenize", json={"prompt": "hello", "return_token_strs": True}).json()["token_strs"]
        assert c.post("/tokenize", json={"model": model, "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
        assert c.post("/tokenize", json={"inputs": "hello"}).status_code == 200  # LoRAX's
        assert c.post("/detokenize", json={"model": model, "tokens": [5, 6, 7]}).status_code == 200
    assert tok.threads and all(name.startswith("loraplex-tokenize") for name in tok.threads), tok.threads


def test_server_keeps_answering_while_a_prompt_is_tokenized(world):
    """A stream already running keeps streaming, /health answers, and a token-id request (which
    needs no tokenizer) is admitted and answered, all while another prompt is held mid-tokenize."""
    srv, key, tok = world
    model = srv.app.state.ctx.served_model_name
    srv.engine.step_seconds = 0.02
    held: dict = {}

    def send_held():
        with srv.tenant_client(key) as c:
            held["response"] = c.post("/v1/completions", json={"model": model, "prompt": HOLD, "max_tokens": 2})

    with srv.tenant_client(key) as c:
        c.timeout = httpx.Timeout(5)
        with c.stream("POST", "/v1/completions",
                      json={"model": model, "prompt": [5, 6, 7], "max_tokens": 40, "stream": True}) as running:
            lines = running.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            sender = threading.Thread(target=send_held)
            sender.start()
            try:
                assert tok.holding.wait(10)
                rest = [line for line in lines if line.startswith("data: ")]  # the stream goes on to its end
                assert httpx.get(srv.url + "/health", timeout=2).status_code == 200
                ids_only = c.post("/v1/completions", json={"model": model, "prompt": [8, 9], "max_tokens": 2})
                assert "response" not in held  # the held prompt is still being tokenized
            finally:
                tok.release.set()
                sender.join(10)
    assert first and rest[-1] == "data: [DONE]" and len(rest) >= 40
    assert ids_only.status_code == 200 and held["response"].status_code == 200
