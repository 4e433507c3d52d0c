"""Requests still running when the drain's grace ends answer a 503 ``server_shutting_down`` in
their API's own error shape: a JSON error (OpenAI's envelope, LoRAX's, SGLang's) with
``Retry-After``, or, where a stream's headers are out, its error event and end. Before, uvicorn
cancelled them: a text/plain 500 (a stream just stopped) and an "Exception in ASGI application"
traceback logged for each."""

from __future__ import annotations

import json
import logging
import signal
import threading
import time

import httpx

from tests.server.fakes import FakeEngine

LONG = 200  # tokens: at the fake's 0.05 s a step, far past the grace


def _data_lines(text: str) -> list[str]:
    return [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]


def test_requests_past_the_grace_answer_a_503_in_their_own_shape(server_factory, caplog):
    engine = FakeEngine(step_seconds=0.05, max_model_len=512)
    srv = server_factory(engine=engine, draining=True, shutdown_grace_seconds=0.5)
    srv.server.config.timeout_graceful_shutdown = 1  # as `loraplex serve` sets it
    key = srv.make_tenant("acme")
    calls = {
        "openai": ("/t/acme/v1/completions", {"model": "fake-model", "prompt": "hi", "max_tokens": LONG}),
        "openai_stream": ("/t/acme/v1/chat/completions", {
            "model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG,
            "stream": True}),
        "lorax": ("/t/acme/generate", {"inputs": "hi", "parameters": {"max_new_tokens": LONG}}),
        "lorax_stream": ("/t/acme/generate_stream", {"inputs": "hi", "parameters": {"max_new_tokens": LONG}}),
        "sglang": ("/t/acme/generate", {"text": "hi", "sampling_params": {"max_new_tokens": LONG}}),
    }
    answers: dict[str, httpx.Response] = {}

    def call(name: str) -> None:
        path, body = calls[name]
        with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
            answers[name] = client.post(path, json=body)

    threads = [threading.Thread(target=call, args=(name,)) for name in calls]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while len(engine.blocks_in_use) < len(calls):  # all running in the engine
        assert time.monotonic() < deadline, engine.blocks_in_use
        time.sleep(0.02)
    with caplog.at_level(logging.INFO):
        srv.server.handle_exit(signal.SIGTERM, None)
        for t in threads:
            t.join(20)
        srv.thread.join(20)
    assert not srv.thread.is_alive()  # the server exited once they had answered

    message = "The server is shutting down: this request ran past its shutdown grace period."
    for name in ("openai", "lorax", "sglang"):
        r = answers[name]
        assert r.status_code == 503, (name, r.text)
        assert r.headers["retry-after"] == "1"
        assert r.headers["content-type"].startswith("application/json")
    assert answers["openai"].json() == {"error": {
        "message": message, "type": "service_unavailable", "param": None, "code": "server_shutting_down"}}
    assert answers["lorax"].json()["error"] == message and "error_type" in answers["lorax"].json()
    assert answers["sglang"].json() == {"error": {"message": message}}

    chat = answers["openai_stream"]
    assert chat.status_code == 200
    events = _data_lines(chat.text)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
    assert all("choices" in json.loads(e) for e in events[:-2])  # what it generated came first

    lorax = answers["lorax_stream"]
    assert lorax.status_code == 200
    last = json.loads(_data_lines(lorax.text)[-1])
    assert last["error"] == message

    assert engine.blocks_in_use == {}
    records = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert records == [], [r.getMessage() for r in records]
    assert any("ended with a 503" in r.getMessage() for r in caplog.records)
    access = [json.loads(r.getMessage()) for r in caplog.records if r.name == "loraplex.access"]
    assert sorted(a["status"] for a in access) == [503] * len(calls)
