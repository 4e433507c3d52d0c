"""A client that goes away aborts its engine request within a second and frees its KV blocks."""

from __future__ import annotations

import socket
import time

import httpx

from tests.server.fakes import FakeEngine


def _raw_request(url: str, path: str, key: str, body: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def _wait(predicate, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.01)
    raise AssertionError("condition not met in time")


def test_disconnect_mid_stream_aborts(server_factory):
    engine = FakeEngine(step_seconds=0.05, max_model_len=4096)
    srv = server_factory(engine)
    key = srv.make_tenant("acme")
    body = b'{"model": "fake-model", "prompt": "hello", "max_tokens": 1000, "stream": true}'
    sock = _raw_request(srv.url, "/v1/completions", key, body)
    received = b""
    while b"data: " not in received:  # streaming has begun
        chunk = sock.recv(4096)
        assert chunk, "connection closed early"
        received += chunk
    assert engine.stats()["num_blocks_free"] < engine.num_blocks
    sock.close()
    took = _wait(lambda: engine.stats()["num_blocks_free"] == engine.num_blocks, 2.0)
    assert took < 1.0
    assert len(engine.aborted) == 1
    _wait(lambda: srv.app.state.ctx.limiter.in_flight() == 0, 1.0)  # tenant slot given back


def test_disconnect_before_non_stream_response_aborts(server_factory):
    engine = FakeEngine(step_seconds=0.05, max_model_len=4096)
    srv = server_factory(engine)
    key = srv.make_tenant("acme")
    body = b'{"model": "fake-model", "prompt": "hello", "max_tokens": 1000}'
    sock = _raw_request(srv.url, "/v1/completions", key, body)
    _wait(lambda: engine.started, 2.0)
    time.sleep(0.2)
    assert engine.stats()["num_requests_running"] == 1
    sock.close()
    took = _wait(lambda: engine.stats()["num_blocks_free"] == engine.num_blocks, 2.0)
    assert took < 1.0
    assert engine.aborted
    _wait(lambda: srv.app.state.ctx.lifecycle.in_flight == 0, 1.0)
    # the server still serves
    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {key}"}) as c:
        assert c.post("/v1/completions", json={"model": "fake-model", "prompt": "a", "max_tokens": 1}).status_code == 200
