"""SGLang's ``POST /abort_request`` over the fake engine, against SGLang's contract
(sgl-project/sglang http_server.py ``abort_request``: 200 and an empty body, known ``rid`` or
not; io_struct.py ``AbortReq``; tokenizer_manager.py ``_handle_abort_req`` and schedule_batch.py
``FINISH_ABORT.to_json`` for the aborted output's ``finish_reason``). Expected texts come from
the fake engine's own token function, not from the code under test."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from tests.server.conftest import start_server
from tests.server.fakes import FakeEngine, expected_text

RUNNING_ABORT = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
QUEUED_ABORT = {"type": "abort", "message": "Abort in waiting queue"}


class GatedEngine(FakeEngine):
    """The fake engine, whose requests wait (queued: no token yet) while ``gate`` is closed."""

    def __init__(self):
        super().__init__(step_seconds=0.02)
        self.gate = threading.Event()
        self.gate.set()

    async def generate(self, prompt, params, request_id=None, **kwargs):
        with self._lock:
            self.started.append((request_id, None))  # seen (queued) before its first token
        while not self.gate.is_set():
            await asyncio.sleep(0.005)
        async for out in super().generate(prompt, params, request_id=request_id, **kwargs):
            yield out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("abort"), GatedEngine())
    keys = {t: srv.make_tenant(t) for t in ("ab", "other")}
    clients = {t: srv.tenant_client(k) for t, k in keys.items()}
    yield srv, clients
    for c in clients.values():
        c.close()
    srv.stop()


def _body(text: str, rid, max_new: int, stream: bool) -> dict:
    return {"text": text, "rid": rid, "stream": stream, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}}


def _data(line: str):
    return None if not line.startswith("data: ") or line == "data: [DONE]" else json.loads(line[6:])


def _abort(client, **body) -> httpx.Response:
    r = client.post("/abort_request", json=body)
    assert r.status_code == 200 and r.content == b"", r.text  # SGLang's answer, rid known or not
    return r


def _wait_started(srv, count: int) -> None:
    deadline = time.monotonic() + 5
    while len(srv.engine.started) < count:
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_abort_of_a_running_stream_ends_it_as_sglang_does(world):
    srv, clients = world
    tok = srv.engine.tokenizer
    ids = tok("abort me")["input_ids"]
    with clients["ab"].stream("POST", "/generate", json=_body("abort me", "run-1", 100, True)) as r:
        lines = r.iter_lines()
        first = next(d for d in map(_data, lines) if d)
        assert first["meta_info"]["finish_reason"] is None
        _abort(clients["other"], rid="run-1")  # another tenant's rid: unknown to it, untouched
        _abort(clients["other"], abort_all=True)
        second = next(d for d in map(_data, lines) if d)
        assert second["meta_info"]["finish_reason"] is None and len(second["output_ids"]) > 1
        _abort(clients["ab"], rid="run-1")
        rest = list(lines)
    assert [x for x in rest if x.startswith("data: ")][-1] == "data: [DONE]"  # the stream ends
    last = [d for d in map(_data, rest) if d][-1]
    meta = last["meta_info"]
    assert meta["id"] == "run-1" and meta["finish_reason"] == RUNNING_ABORT
    n = len(last["output_ids"])
    assert 1 < n < 100 and meta["completion_tokens"] == n and "e2e_latency" in meta
    assert last["text"] == expected_text(tok, ids, None, None, n)  # what ran, up to the abort
    engine_ids = [rid for rid, _ in srv.engine.started if rid in srv.engine.aborted]
    assert engine_ids and not any(rid in srv.engine.blocks_in_use for rid in engine_ids)


def test_abort_of_a_queued_request(world):
    srv, clients = world
    srv.engine.gate.clear()
    got = {}
    before = len(srv.engine.started)
    t = threading.Thread(target=lambda: got.update(r=clients["ab"].post("/generate", json=_body("q", "queued-1", 20, False))))
    t.start()
    try:
        _wait_started(srv, before + 1)
        _abort(clients["ab"], rid="queued-1")
    finally:
        srv.engine.gate.set()
    t.join(5)
    r = got["r"]
    assert r.status_code == 200, r.text  # SGLang answers an aborted output, not an error
    body = r.json()
    assert body["meta_info"]["finish_reason"] == QUEUED_ABORT and body["meta_info"]["id"] == "queued-1"
    assert body["output_ids"] == [] and body["text"] == "" and body["meta_info"]["completion_tokens"] == 0


def test_abort_all_aborts_only_the_callers_own(world):
    srv, clients = world
    tok = srv.engine.tokenizer
    results = {}

    def call(tenant, key, body):
        results[key] = clients[tenant].post("/generate", json=body)

    calls = [("ab", "one", _body("x", "all-1", 100, False)),
             ("ab", "batch", _body(["y", "z"], ["all-2", "all-3"], 100, False)),
             ("other", "theirs", _body("w", "all-4", 20, False))]
    before = len(srv.engine.started)
    threads = [threading.Thread(target=call, args=c) for c in calls]
    for t in threads:
        t.start()
    _wait_started(srv, before + 4)
    time.sleep(0.1)  # a few tokens each
    _abort(clients["ab"], abort_all=True)
    for t in threads:
        t.join(10)
    one, batch, theirs = (results[k].json() for k in ("one", "batch", "theirs"))
    for out in [one, *batch]:
        assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) < 100
    assert [o["meta_info"]["id"] for o in batch] == ["all-2", "all-3"]
    # the other tenant's call ran to its end
    assert theirs["meta_info"]["finish_reason"] == {"type": "length", "length": 20}
    assert theirs["text"] == expected_text(tok, tok("w")["input_ids"], None, None, 20)


def test_unknown_rid_and_bad_bodies(world):
    srv, clients = world
    _abort(clients["ab"], rid="never-given")
    _abort(clients["ab"])  # SGLang's defaults: rid "", abort_all false: nothing to do
    for body, field in (({"rid": 5}, "rid"), ({"abort_all": "yes"}, "abort_all")):
        r = clients["ab"].post("/abort_request", json=body)
        assert r.status_code == 400 and field in r.json()["error"]["message"]
    assert clients["ab"].post("/abort_request", content=b"[1]").status_code == 400
    assert httpx.post(f"{srv.url}/abort_request", json={"abort_all": True}).status_code == 401
    # under /t/{tenant}: the key's own tenant only
    assert clients["ab"].post("/t/ab/abort_request", json={"rid": "x"}).status_code == 200
    assert clients["other"].post("/t/ab/abort_request", json={"abort_all": True}).status_code in (401, 403)
