"""Request ids in the logs (a real uvicorn server, the fake engine): the access line of a request
names it by the ``x-request-id`` its answer carried and by the client's own ``X-Request-Id``
(``client_request_id``), served or refused; so do the warnings and errors logged while serving
it. A client id is never a key inside the server: two requests sending the same one both run."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest

from loraplex.lora.errors import AdapterHashMismatchError
from tests.server.fakes import FakeEngine

MODEL = "fake-model"
PROMPT = {"model": MODEL, "prompt": "hello", "max_tokens": 4}


def _access_lines(caplog, count: int, timeout: float = 5.0) -> list[dict]:
    """The access lines logged so far, once there are ``count`` (a stream's is written as it
    closes, after its last bytes reached the client)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "loraplex.access"
                 and r.levelno == logging.INFO]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.02)


@pytest.fixture(scope="module")
def tenant(module_server):
    key = module_server.make_tenant("logs")
    with module_server.tenant_client(key) as client:
        yield module_server, client


def test_a_served_request_is_logged_by_both_ids(tenant, caplog):
    _, client = tenant
    with caplog.at_level(logging.INFO, logger="loraplex.access"):
        whole = client.post("/v1/completions", json=PROMPT, headers={"X-Request-Id": "gw-1"})
        streamed = client.post("/v1/chat/completions", headers={"X-Request-Id": "gw-2"},
                               json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                     "max_tokens": 2, "stream": True})
        lines = _access_lines(caplog, 2)
    assert whole.status_code == streamed.status_code == 200
    assert [(line["request_id"], line["client_request_id"], line["status"]) for line in lines] == [
        (whole.json()["id"], "gw-1", 200), (streamed.headers["x-request-id"], "gw-2", 200)]
    assert (whole.headers["x-client-request-id"], streamed.headers["x-client-request-id"]) == ("gw-1", "gw-2")


def test_refused_requests_are_logged_by_both_ids(tenant, caplog):
    srv, client = tenant
    with caplog.at_level(logging.INFO, logger="loraplex.access"):
        answers = [
            httpx.post(srv.url + "/v1/completions", json=PROMPT, headers={"X-Request-Id": "no-key"}),
            client.post("/v1/completions", json={**PROMPT, "model": "missing"}, headers={"X-Request-Id": "no-model"}),
            client.post("/v1/completions", json={**PROMPT, "n": "two"}, headers={"X-Request-Id": "bad-n"}),
            client.post("/generate", json={"inputs": "x", "parameters": {"watermark": True}},
                        headers={"X-Request-Id": "lorax"}),
        ]
        lines = _access_lines(caplog, 4)
    assert [r.status_code for r in answers] == [401, 404, 400, 422]
    assert [(line["request_id"], line["client_request_id"], line["status"]) for line in lines] == [
        (r.headers["x-request-id"], sent, r.status_code)
        for r, sent in zip(answers, ["no-key", "no-model", "bad-n", "lorax"])]
    assert [r.headers["x-client-request-id"] for r in answers] == ["no-key", "no-model", "bad-n", "lorax"]


@pytest.mark.parametrize("sent, kept", [
    ("a" * 128, True),
    ("trace-00f067aa0ba902b7:1", True),
    ("a" * 129, False),  # longer than the limit
    ("two words", False),
    ("", False),
    (b"caf\xc3\xa9", False),  # not ASCII
    ("tab\there", False),
])
def test_only_a_valid_client_id_is_logged_and_echoed(tenant, caplog, sent, kept):
    _, client = tenant
    with caplog.at_level(logging.INFO, logger="loraplex.access"):
        r = client.post("/v1/completions", json=PROMPT, headers={"X-Request-Id": sent})
        (line,) = _access_lines(caplog, 1)
    assert r.status_code == 200  # an id that is not kept refuses nothing
    want = sent if kept else None
    assert line["client_request_id"] == want and r.headers.get("x-client-request-id") == want
    assert line["request_id"] == r.headers["x-request-id"] == r.json()["id"]


def test_two_requests_with_one_client_id_both_run_apart(server_factory, caplog):
    srv = server_factory(FakeEngine(step_seconds=0.02))
    key = srv.make_tenant("twins")
    body = {**PROMPT, "max_tokens": 20}
    with srv.tenant_client(key) as client:
        reference = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        with caplog.at_level(logging.INFO, logger="loraplex.access"):
            with client.stream("POST", "/v1/completions", json={**body, "stream": True},
                               headers={"X-Request-Id": "same"}) as first:
                lines = first.iter_lines()  # kept: a dropped iterator closes the stream
                head = next(lines)  # the first is running while the second runs
                second = client.post("/v1/completions", json=body, headers={"X-Request-Id": "same"})
                chunks = [head, *(line for line in lines if line.startswith("data:") and line != "data: [DONE]")]
            logged = _access_lines(caplog, 2)
    assert second.status_code == first.status_code == 200
    ids = [first.headers["x-request-id"], second.headers["x-request-id"]]
    assert ids[0] != ids[1] and second.json()["id"] == ids[1]
    first_text = "".join(json.loads(chunk[5:])["choices"][0]["text"] for chunk in chunks)
    assert first_text == second.json()["choices"][0]["text"] == reference
    started = [rid for rid, _ in srv.engine.started]
    assert started[-2:] == [f"{ids[0]}-0", f"{ids[1]}-0"]  # the engine never sees the client's id
    assert sorted((line["request_id"], line["client_request_id"], line["status"]) for line in logged) == sorted(
        [(ids[0], "same", 200), (ids[1], "same", 200)])


class FailingEngine(FakeEngine):
    """Fails every base-model request as an engine bug would; an adapter's files changed."""

    async def generate(self, prompt, params, request_id=None, adapter=None, cache_salt=None, priority=0,
                       tenant=None, tenant_weight=1.0):
        if adapter is not None:
            raise AdapterHashMismatchError(f"adapter files at {adapter.path!r} changed since they were loaded")
        raise RuntimeError("engine exploded")
        yield  # an async generator, as the engine's is


def test_warnings_and_errors_while_serving_name_the_request(server_factory, caplog):
    srv = server_factory(FailingEngine())
    key = srv.make_tenant("acme")
    srv.upload("acme", "sql", b"v1")
    with caplog.at_level(logging.WARNING), srv.tenant_client(key) as client:
        adapter = client.post("/v1/completions", json={**PROMPT, "model": "sql"})
        whole = client.post("/v1/completions", json=PROMPT)
        streamed = client.post("/v1/completions", json={**PROMPT, "stream": True})
    assert (adapter.status_code, whole.status_code, streamed.status_code) == (400, 500, 200)
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    failed_load = [m for m in messages if "failed to load" in m]
    internal = [m for m in messages if m.startswith("internal error")]
    assert len(failed_load) == 1 and adapter.headers["x-request-id"] in failed_load[0]
    assert internal == [f"internal error (request {whole.headers['x-request-id']})",
                        f"internal error (request {streamed.headers['x-request-id']})"]
    assert whole.headers["x-request-id"].startswith("cmpl-") and "engine exploded" not in whole.text


def test_vllms_request_id_field_names_the_answer(tenant, caplog):
    """vLLM's ``request_id`` body field: the answer's ``id`` is ``cmpl-<it>`` / ``chatcmpl-<it>``,
    as vLLM answers, streamed or not; it is logged and echoed as an X-Request-Id header is (the
    header wins when both come). Two requests naming the same one both run: the server's own id
    (``x-request-id``, the access line's ``request_id``) stays unique. One that no log should
    hold (a space, over 128 characters) is a 400 naming it."""
    srv, client = tenant
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with caplog.at_level(logging.INFO, logger="loraplex.access"):
        first = client.post("/v1/completions", json={**PROMPT, "request_id": "job-42"})
        second = client.post("/v1/completions", json={**PROMPT, "request_id": "job-42"})
        streamed = client.post("/v1/chat/completions", json={**chat, "request_id": "job-43", "stream": True})
        both = client.post("/v1/chat/completions", json={**chat, "request_id": "job-44"},
                           headers={"X-Request-Id": "gw-9"})
        lines = _access_lines(caplog, 4)
    assert [r.status_code for r in (first, second, streamed, both)] == [200] * 4
    assert first.json()["id"] == second.json()["id"] == "cmpl-job-42"
    chunks = [json.loads(line[5:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert chunks and {c["id"] for c in chunks} == {"chatcmpl-job-43"}
    assert both.json()["id"] == "chatcmpl-job-44"
    server_ids = [r.headers["x-request-id"] for r in (first, second, streamed, both)]
    assert len(set(server_ids)) == 4 and all(i.startswith(("cmpl-", "chatcmpl-")) for i in server_ids)
    assert [(line["request_id"], line["client_request_id"]) for line in lines] == list(
        zip(server_ids, ["job-42", "job-42", "job-43", "gw-9"]))
    assert [r.headers["x-client-request-id"] for r in (first, second, streamed, both)] == [
        "job-42", "job-42", "job-43", "gw-9"]
    for bad in ("has space", "x" * 129, 7):
        r = client.post("/v1/completions", json={**PROMPT, "request_id": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", r.text
