"""``POST /v1/responses``: a client that goes away mid-stream (plain text, and with the tool-call
and reasoning parsers reading the output) or before a whole answer aborts its engine request,
frees its KV blocks and gives back its tenant and drain slots and its adapter pin."""

from __future__ import annotations

import json

import pytest

from tests.server.fakes import FakeEngine
from tests.server.test_disconnect_fake import _raw_request, _wait


def _nothing_held(srv, sha) -> None:
    ctx = srv.app.state.ctx
    _wait(lambda: ctx.limiter.in_flight() == 0 and ctx.lifecycle.in_flight == 0, 2.0)
    _wait(lambda: srv.adapters.in_use.get(sha, 0) == 0, 2.0)
    assert srv.engine.stats()["num_blocks_free"] == srv.engine.num_blocks


def _serve(server_factory, **settings):
    engine = FakeEngine(step_seconds=0.05, max_model_len=4096)
    srv = server_factory(engine, **settings)
    key = srv.make_tenant("acme")
    sha = srv.upload("acme", "sql", config=b"{}")["sha256"]
    return srv, key, sha


@pytest.mark.parametrize("settings", [{}, {"tool_call_parser": "hermes", "reasoning_parser": "deepseek_r1"}])
def test_disconnect_mid_stream_aborts_and_holds_nothing(server_factory, settings):
    srv, key, sha = _serve(server_factory, **settings)
    tools = [{"type": "function", "name": "f"}] if settings else []
    body = json.dumps({"model": "sql", "input": "hello", "max_output_tokens": 1000, "stream": True,
                       "tools": tools}).encode()
    sock = _raw_request(srv.url, "/v1/responses", key, body)
    received = b""
    while b"response.output_item.added" not in received and b"delta" not in received:
        chunk = sock.recv(4096)
        assert chunk, "connection closed early"
        received += chunk
    assert srv.adapters.in_use.get(sha, 0) == 1
    sock.close()
    assert _wait(lambda: srv.engine.aborted, 2.0) < 1.0
    _nothing_held(srv, sha)


def test_disconnect_before_the_whole_answer_aborts(server_factory):
    srv, key, sha = _serve(server_factory)
    body = json.dumps({"model": "sql", "input": "hello", "max_output_tokens": 1000}).encode()
    sock = _raw_request(srv.url, "/v1/responses", key, body)
    _wait(lambda: srv.engine.started, 2.0)
    sock.close()
    assert _wait(lambda: srv.engine.aborted, 2.0) < 1.0
    _nothing_held(srv, sha)
