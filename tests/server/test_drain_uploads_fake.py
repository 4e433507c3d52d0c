"""A drain waits for an adapter upload in flight, as for a generation request: SIGTERM while its
body is still arriving, and it completes (201, its version stored) before the server exits;
an upload that comes once draining is a 503 that stores nothing. Before, uploads were not
counted: the drain found nothing in flight and uvicorn cut the upload a second later (a 500)."""

from __future__ import annotations

import signal
import threading
import time
import uuid

import httpx

from tests.server.conftest import ADMIN_KEY


def _multipart(payload: bytes) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    parts = []
    for name, data in (("adapter_config.json", b"{}"), ("adapter_model.safetensors", payload)):
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{name}"\r\n'
                     f"Content-Type: application/octet-stream\r\n\r\n".encode() + data + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), boundary


def test_a_drain_waits_for_an_upload_in_flight(server_factory):
    srv = server_factory(draining=True, shutdown_grace_seconds=30)
    srv.make_tenant("acme")
    lifecycle = srv.app.state.ctx.lifecycle
    body, boundary = _multipart(b"w" * 200_000)
    started = threading.Event()

    def slow_body():  # about 2 s of body, the SIGTERM after its first chunk
        for at in range(0, len(body), 20_000):
            yield body[at:at + 20_000]
            started.set()
            time.sleep(0.2)

    headers = {"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": f"multipart/form-data; boundary={boundary}"}
    answer = {}

    def upload():
        answer["r"] = httpx.post(srv.url + "/admin/v1/tenants/acme/adapters/sql/versions", content=slow_body(),
                                 headers=headers, timeout=30)

    thread = threading.Thread(target=upload)
    thread.start()
    assert started.wait(10)
    time.sleep(0.3)
    assert lifecycle.in_flight == 1  # counted while its body arrives
    srv.server.handle_exit(signal.SIGTERM, None)
    deadline = time.monotonic() + 5
    while not lifecycle.draining:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    refused = httpx.post(srv.url + "/admin/v1/tenants/acme/adapters/late/versions", content=_multipart(b"x")[0],
                         headers=headers, timeout=10)
    thread.join(30)
    assert answer["r"].status_code == 201, answer["r"].text
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
    assert [v.version for v in srv.registry.get_adapter("acme", "sql").versions] == [1]
    assert srv.registry.get_adapter("acme", "late") is None
    srv.thread.join(10)  # the drain ended with the upload: the server exits
    assert not srv.thread.is_alive()
