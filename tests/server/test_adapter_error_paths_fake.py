"""An adapter that fails to load after admission (its files changed or went missing on the
server) is answered with what is wrong, but not with where the server keeps the files: the
tenant's 400 leaves the local directory out; the operator's log keeps it."""

from __future__ import annotations

import logging

from loraplex.lora.errors import AdapterHashMismatchError
from tests.server.fakes import FakeEngine


class BrokenFilesEngine(FakeEngine):
    """Refuses every adapter request as the real engine does when the files changed under it."""

    async def generate(self, prompt, params, request_id=None, adapter=None, cache_salt=None, priority=0,
                       tenant=None, tenant_weight=1.0):
        if adapter is not None:
            raise AdapterHashMismatchError(f"adapter files at {adapter.path!r} changed since they were loaded")
        async for out in super().generate(prompt, params, request_id, adapter, cache_salt):
            yield out


def test_the_tenant_sees_no_server_path(server_factory, caplog):
    srv = server_factory(BrokenFilesEngine())
    key = srv.make_tenant("acme")
    srv.upload("acme", "sql", b"v1")
    with caplog.at_level(logging.WARNING, logger="loraplex.access"), srv.tenant_client(key) as c:
        r = c.post("/v1/completions", json={"model": "sql", "prompt": [5, 6], "max_tokens": 2})
        streamed = c.post("/v1/completions", json={"model": "sql", "prompt": [5, 6], "max_tokens": 2, "stream": True})
    home = str(srv.adapters.root)
    assert r.status_code == 400 and r.json()["error"]["param"] == "adapter"
    message = r.json()["error"]["message"]
    assert "changed since they were loaded" in message and "<adapter files>" in message and home not in message
    assert "<adapter files>" in streamed.text and home not in streamed.text
    assert any(home in rec.getMessage() for rec in caplog.records)  # the operator's log has the path
