"""Request ids through the official ``openai`` client against a real ``loraplex serve`` (the
shared server of compat_server.py): the client's ``_request_id`` (read from ``x-request-id``) is
the completion's own id, its exceptions carry the id of the refusal, and the server's access
line names both that id and the ``X-Request-Id`` the client sent."""

from __future__ import annotations

import json
import time

import openai
import pytest

from tests.e2e.compat_server import client, srv  # noqa: F401 (fixtures)
from tests.e2e.compat_server import MESSAGES

pytestmark = pytest.mark.slow


def _access_line(srv, request_id: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in srv.log().splitlines():
            if line.startswith('{"event":"request"') and json.loads(line)["request_id"] == request_id:
                return json.loads(line)
        time.sleep(0.1)
    raise AssertionError(f"no access line for {request_id}")


def test_the_clients_request_id_is_the_completions_id(srv, client):
    comp = client.completions.create(model="base-model", prompt="hi", max_tokens=2)
    assert comp._request_id == comp.id and comp.id.startswith("cmpl-")
    raw = client.chat.completions.with_raw_response.create(
        model="base-model", messages=MESSAGES, max_tokens=2, extra_headers={"X-Request-Id": "e2e-chat-1"})
    chat = raw.parse()
    assert raw.request_id == raw.headers["x-request-id"] == chat.id and chat.id.startswith("chatcmpl-")
    assert raw.headers["x-client-request-id"] == "e2e-chat-1"
    line = _access_line(srv, chat.id)
    assert (line["client_request_id"], line["status"]) == ("e2e-chat-1", 200)


def test_a_streams_request_id_is_its_chunks_id(client):
    stream = client.chat.completions.create(model="base-model", messages=MESSAGES, max_tokens=2, stream=True)
    ids = {chunk.id for chunk in stream}
    assert ids == {stream.response.headers["x-request-id"]}


def test_an_exception_carries_the_refusals_id(srv, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-adapter", prompt="x", max_tokens=1,
                                  extra_headers={"X-Request-Id": "e2e-missing"})
    assert info.value.request_id and info.value.request_id.startswith("req_")
    line = _access_line(srv, info.value.request_id)
    assert (line["client_request_id"], line["status"], line["model"]) == ("e2e-missing", 404, "no-such-adapter")
