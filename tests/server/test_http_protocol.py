"""Which HTTP protocol ``loraplex serve`` runs uvicorn with: httptools (a dependency, as in the
``uvicorn[standard]`` vLLM installs) by default, with a bound on a request's head that uvicorn's
httptools protocol lacks, and h11 when ``--h11-max-incomplete-event-size`` is given, since that
limit is h11's alone: under httptools it would bound nothing. Checked on the ``uvicorn.Config``
``loraplex serve`` builds (its resolved protocol class) and on the wire (a head over the limit is
answered 400, as h11 answers, and one under it is served)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from loraplex.server import cli
from loraplex.server.cli import settings_from_args
from loraplex.server.http_protocol import MAX_HEAD_BYTES, BoundedHttpToolsProtocol
from tests.server.cli_parsing import no_cli_env, parsed  # noqa: F401 (fixtures)
from tests.fixtures.ports import free_port

pytestmark = pytest.mark.usefixtures("no_cli_env")


async def ok_app(scope, receive, send):
    """Answers every request 200 with an empty body (and the lifespan's start and stop)."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})


def serve_config(parsed, *flags: str) -> uvicorn.Config:
    args = parsed(["serve", "m", "--port", str(free_port()), *flags])
    config = cli.uvicorn_config(ok_app, settings_from_args(args), args)
    config.load()
    return config


def test_httptools_serves_by_default(parsed):
    protocol = serve_config(parsed).http_protocol_class
    assert protocol is BoundedHttpToolsProtocol and issubclass(protocol, HttpToolsProtocol)


def test_h11s_event_size_flag_picks_h11_with_its_limit(parsed):
    config = serve_config(parsed, "--h11-max-incomplete-event-size", "2048")
    assert config.http_protocol_class is H11Protocol
    assert config.h11_max_incomplete_event_size == 2048


def status_of_request_with_header(config: uvicorn.Config, header_bytes: int) -> int:
    """The status ``config``'s server answers a GET whose one extra header is ``header_bytes`` long."""
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        with socket.create_connection((config.host, config.port), timeout=10) as conn:
            # the head in two writes: h11 measures only a head still incomplete after a read
            conn.sendall(b"GET /ping HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * header_bytes)
            time.sleep(0.3)
            try:
                conn.sendall(b"\r\n\r\n")
            except OSError:  # h11 already answered and closed
                pass
            head = conn.recv(64)
        return int(head.split(b" ")[1])
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_head_over_the_h11_limit_is_refused_when_the_flag_is_given(parsed):
    # h11 refuses a request whose head outgrows max_incomplete_event_size (uvicorn answers 400)
    assert status_of_request_with_header(serve_config(parsed, "--h11-max-incomplete-event-size", "2048"), 4096) == 400
    assert status_of_request_with_header(serve_config(parsed, "--h11-max-incomplete-event-size", "8192"), 4096) == 200


def test_httptools_refuses_a_head_over_vllms_limit(parsed):
    # uvicorn's own httptools protocol takes any head; vLLM's h11 limit is 4 MiB
    assert MAX_HEAD_BYTES == 4 * 1024 * 1024
    assert status_of_request_with_header(serve_config(parsed), 64 * 1024) == 200
    assert status_of_request_with_header(serve_config(parsed), MAX_HEAD_BYTES - 64 * 1024) == 200
    assert status_of_request_with_header(serve_config(parsed), MAX_HEAD_BYTES + 1024) == 400


def test_the_head_bound_restarts_with_each_request_on_a_connection(parsed):
    """Keep-alive: heads of several requests on one connection add up to more than the bound,
    each under it; a body is not a head (a POST body over the bound is the app's to refuse)."""
    config = serve_config(parsed)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    pad = b"a" * (MAX_HEAD_BYTES // 2)
    body = b"b" * (MAX_HEAD_BYTES + 1024)
    try:
        with socket.create_connection((config.host, config.port), timeout=10) as conn:
            reader = conn.makefile("rb")
            for request in [b"GET /1 HTTP/1.1\r\nhost: x\r\nx-pad: " + pad + b"\r\n\r\n"] * 3 + [
                    b"POST /2 HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body) + body]:
                conn.sendall(request)
                assert reader.readline().split(b" ")[1] == b"200"
                while reader.readline() != b"\r\n":  # the rest of the head; the body is empty
                    pass
    finally:
        server.should_exit = True
        thread.join(timeout=10)
