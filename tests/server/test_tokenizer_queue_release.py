"""A request holds its adapter version from ``resolve_target`` on, so every way out of the
tokenizer thread must give it back: a client that gives up while its prompt waits there, a
tokenizer that raises, a request queued behind a held prompt. Nothing stays held (adapter
version, tenant slot, drain count) and the server answers the next request."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.conftest import start_server
from tests.server.fakes import FakeEngine
from tests.server.test_tokenizer_thread import HOLD, RecordingTokenizer

BOOM = "tokenizer blows up"


class RaisingTokenizer(RecordingTokenizer):
    def __call__(self, text, *args, **kwargs):
        if isinstance(text, str) and BOOM in text:
            raise RuntimeError("tokenizer failure")
        return super().__call__(text, *args, **kwargs)


@pytest.fixture
def world(tmp_path):
    engine = FakeEngine()
    tok = engine.tokenizer = RaisingTokenizer()
    srv = start_server(tmp_path, engine)
    key = srv.make_tenant("tq")
    srv.upload("tq", "ad", b"tq-v1")
    yield srv, key, tok
    tok.release.set()
    srv.stop()


def _nothing_held(srv) -> bool:
    ctx = srv.app.state.ctx
    return (all(v == 0 for v in srv.adapters.in_use.values()) and ctx.limiter.in_flight() == 0
            and ctx.lifecycle.in_flight == 0)


def _settles(srv, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _nothing_held(srv):
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("stream", [False, True])
def test_clients_gone_while_waiting_for_the_tokenizer_hold_nothing(world, stream):
    srv, key, tok = world

    def give_up(prompt):
        with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {key}"}, timeout=0.3) as c:
            with pytest.raises(httpx.TimeoutException):
                c.post("/v1/completions", json={"model": "ad", "prompt": prompt, "max_tokens": 2, "stream": stream})

    held = threading.Thread(target=give_up, args=(HOLD,))
    held.start()
    assert tok.holding.wait(10)
    give_up("queued behind the held prompt")  # waits in the tokenizer queue, then gives up
    held.join(10)
    assert srv.adapters.in_use and not _nothing_held(srv)  # still inside admission
    tok.release.set()
    assert _settles(srv), (srv.adapters.in_use, srv.app.state.ctx.limiter.in_flight())
    with srv.tenant_client(key) as c:
        assert c.post("/v1/completions", json={"model": "ad", "prompt": "hi", "max_tokens": 2}).status_code == 200
    assert _settles(srv)


def test_a_tokenizer_that_raises_gives_everything_back(world):
    srv, key, _ = world
    for path, body in [("/v1/completions", {"model": "ad", "prompt": BOOM, "max_tokens": 2}),
                       ("/v1/chat/completions", {"model": "ad", "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": BOOM}]}),
                       ("/generate", {"inputs": BOOM, "parameters": {"adapter_id": "ad", "max_new_tokens": 2}})]:
        with srv.tenant_client(key) as c:  # uvicorn closes a connection after an unknown error's 500
            r = c.post(path, json=body)
        assert r.status_code == 500, (path, r.text)
    assert _settles(srv)
    with srv.tenant_client(key) as c:
        assert c.post("/v1/completions", json={"model": "ad", "prompt": "hi", "max_tokens": 2}).status_code == 200
    assert _settles(srv)
