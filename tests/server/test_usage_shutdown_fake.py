"""Usage of requests still running when the server stops: uvicorn cancels them once its graceful
shutdown times out and runs the app's shutdown at once, without waiting for them; their
cleanup (closing the run, which counts its usage) takes a few event-loop turns after that. The
last usage flush must come after it, or their usage is summed into a recorder already stopped
and lost."""

from __future__ import annotations

import asyncio
import threading

import httpx

from tests.server.conftest import start_server
from tests.server.fakes import FakeEngine

CLEANUP_SECONDS = 0.3  # a run's cleanup outlasting the app's own shutdown steps


class SlowCleanupEngine(FakeEngine):
    async def generate(self, *args, **kwargs):
        try:
            async for out in super().generate(*args, **kwargs):
                yield out
        finally:
            await asyncio.sleep(CLEANUP_SECONDS)  # freeing the request's state takes a while


def test_requests_cancelled_at_shutdown_are_counted(tmp_path):
    srv = start_server(tmp_path, SlowCleanupEngine(step_seconds=0.05, max_model_len=4096),
                       usage_flush_seconds=3600)
    srv.server.config.timeout_graceful_shutdown = 0.2  # as `loraplex serve` sets it (1 s)
    key = srv.make_tenant("acme")
    received = threading.Event()

    def stream() -> None:
        body = {"model": "fake-model", "prompt": "go on", "max_tokens": 1000, "stream": True}
        try:
            with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
                with c.stream("POST", "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data:"):
                            received.set()
        except httpx.HTTPError:
            pass  # the server went away mid-stream

    client = threading.Thread(target=stream, daemon=True)
    client.start()
    assert received.wait(10)
    srv.stop()  # graceful shutdown times out: the stream is cancelled, then the app shuts down
    client.join(10)
    prompt = len(srv.engine.tokenizer("go on")["input_ids"])
    totals = srv.registry.usage_report(tenant="acme").totals
    assert (totals["requests"], totals["failed_requests"], totals["failed_prompt_tokens"]) == (0, 1, prompt)
    assert 1 <= totals["failed_completion_tokens"] < 1000


class FailingShutdownEngine(FakeEngine):
    def shutdown(self) -> None:
        raise RuntimeError("the accelerator is gone")


def test_usage_is_written_when_the_engine_fails_to_shut_down(tmp_path):
    # the engine's shutdown raising skipped the recorder's last flush: the usage summed since
    # the last interval was lost with the process
    srv = start_server(tmp_path, FailingShutdownEngine(), usage_flush_seconds=3600)
    key = srv.make_tenant("acme")
    with srv.tenant_client(key) as c:
        r = c.post("/v1/completions", json={"model": "fake-model", "prompt": "ab", "max_tokens": 3})
    assert r.status_code == 200
    usage = r.json()["usage"]
    srv.stop()
    totals = srv.registry.usage_report(tenant="acme").totals
    assert (totals["requests"], totals["prompt_tokens"], totals["completion_tokens"]) == \
        (1, usage["prompt_tokens"], usage["completion_tokens"])
