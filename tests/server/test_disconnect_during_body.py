"""A client that hangs up while its request body is still arriving is a closed request (499 in the
metrics and the access log), not a server error: no 500, no traceback in the log. Found by
tests/e2e/test_chaos_e2e.py (clients that give up early): every such call logged "internal error"
with a traceback, counted a 500, and uvicorn logged "Exception in ASGI application"."""

from __future__ import annotations

import logging
import socket
import time

import httpx
import pytest

from tests.server.conftest import ADMIN_KEY


def _half_request(url: str, path: str, key: str, content_type: str, declared: int, sent: bytes) -> None:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {declared}\r\n\r\n")
    sock.sendall(head.encode() + sent)
    time.sleep(0.2)  # the route is reading the body
    sock.close()


def _statuses(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("loraplex_http_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels] = out.get(labels, 0) + float(value)
    return out


@pytest.mark.parametrize("where", ["completions", "admin-json", "upload"])
def test_hang_up_while_sending_the_body(server_factory, caplog, where):
    srv = server_factory()
    key = srv.make_tenant("acme")
    path, ctype, key_used = {
        "completions": ("/v1/completions", "application/json", key),
        "admin-json": ("/admin/v1/tenants", "application/json", ADMIN_KEY),
        "upload": ("/admin/v1/tenants/acme/adapters/x/versions", "multipart/form-data; boundary=zz", ADMIN_KEY),
    }[where]
    sent = b"--zz\r\nContent-Disposition: form-data; name=\"archive\"; filename=\"a.tar\"\r\n\r\nabc" \
        if where == "upload" else b'{"model": "fake-model", "prompt": "hel'
    with caplog.at_level(logging.ERROR):
        _half_request(srv.url, path, key_used, ctype, 5000, sent)
        deadline = time.monotonic() + 3
        while not any('status="499"' in k for k in _statuses(srv.url)) and time.monotonic() < deadline:
            time.sleep(0.05)
    statuses = _statuses(srv.url)
    assert [k for k in statuses if 'status="5' in k] == [], statuses
    assert any('status="499"' in k for k in statuses), statuses
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert srv.app.state.ctx.limiter.in_flight() == 0 and srv.app.state.ctx.lifecycle.in_flight == 0
    with srv.tenant_client(key) as c:  # and the server goes on serving
        assert c.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 2}).status_code == 200
