"""A JSON string may hold a lone UTF-16 surrogate escape (``"\\ud800"``), which no UTF-8 text can
hold: the tokenizer raised TypeError, and an error message echoing it (an unknown ``model``)
failed to encode, so each such body was a 500. Every JSON route now answers 400 (LoRAX's routes:
its 422) and admits nothing; an escaped pair (an emoji from an ``ensure_ascii`` client) is text.
Found by the audit-core attacks on the tokenizer routes."""

from __future__ import annotations

import pytest

from tests.server.conftest import ADMIN_KEY, start_server
from tests.server.fakes import FakeEngine


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("surrogates"), FakeEngine())
    key = srv.make_tenant("ta")
    yield srv, key
    srv.stop()


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", '{"model": "\\ud800", "prompt": "a", "max_tokens": 2}'),
    ("/v1/completions", '{"model": "fake-model", "prompt": ["ok", "a\\udfffb"], "max_tokens": 2}'),
    ("/v1/chat/completions", '{"model": "fake-model", "messages": [{"role": "user", "content": "\\uDC00"}]}'),
    ("/tokenize", '{"prompt": "a\\ud800"}'),
    ("/tokenize", '{"inputs": "a\\ud800"}'),
    ("/detokenize", '{"model": "\\ud800", "tokens": [1]}'),
    ("/generate", '{"inputs": "a\\ud800", "parameters": {"max_new_tokens": 2}}'),
    ("/admin/v1/tenants", '{"name": "x\\ud800"}'),
])
def test_lone_surrogate_is_a_400(world, path, body):
    srv, key = world
    with srv.tenant_client(ADMIN_KEY if path.startswith("/admin") else key) as c:
        r = c.post(path, content=body.encode(), headers={"content-type": "application/json"})
    if path == "/generate":  # LoRAX's route: its status and error shape
        assert r.status_code == 422 and "surrogate" in r.json()["error"], r.text
    else:
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
    assert srv.app.state.ctx.limiter.in_flight() == 0 and srv.app.state.ctx.lifecycle.in_flight == 0


def test_escaped_pair_is_text(world):
    srv, key = world
    with srv.tenant_client(key) as c:
        r = c.post("/tokenize", content=b'{"prompt": "smile \\ud83d\\ude00"}', headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == srv.engine.tokenizer("smile \U0001F600")["input_ids"]
