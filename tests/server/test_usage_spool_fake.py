"""End to end: a server (fake engine, real registry on SQLite) answers requests, loses its
database, and is stopped: the usage it could not write is spooled under its home. Restarted on
the same home with the database back, it replays the spool at start: the billing totals equal
the sums of the usage the responses reported, and a corrupt file found in the spool is set
aside and shown in /admin/v1/status and /metrics."""

from __future__ import annotations

import time

from sqlalchemy.exc import OperationalError

from tests.server.conftest import start_server


class Unreachable:
    """A session factory that cannot connect while ``down``."""

    def __init__(self, factory):
        self.factory, self.down = factory, False

    def __call__(self):
        if self.down:
            raise OperationalError("connect", {}, Exception("connection refused"))
        return self.factory()


def test_usage_of_a_server_stopped_while_the_database_is_down_is_billed_after_restart(tmp_path):
    srv = start_server(tmp_path, usage_flush_seconds=3600)
    sums = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}
    key = srv.make_tenant("acme")
    with srv.tenant_client(key) as client:
        for i in range(6):
            body = {"model": "fake-model", "prompt": "word " * (i + 1), "max_tokens": 2 + i}
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            sums["requests"] += 1
            sums["prompt_tokens"] += r.json()["usage"]["prompt_tokens"]
            sums["completion_tokens"] += r.json()["usage"]["completion_tokens"]
    database = srv.registry._session_factory = Unreachable(srv.registry._session_factory)
    database.down = True
    srv.stop()
    spool_dir = tmp_path / "home" / "usage-spool"
    spooled = sorted(spool_dir.glob("*.json"))
    assert len(spooled) == 1
    database.down = False
    assert srv.registry.usage_report(tenant="acme").totals["requests"] == 0  # nothing reached it
    (spool_dir / "torn.json").write_text('{"format": "loraplex.usage-batch", "vers')

    again = start_server(tmp_path, usage_flush_seconds=3600)  # same home, same database
    try:
        with again.admin() as admin:
            deadline = time.monotonic() + 10
            while True:
                usage = admin.get("/admin/v1/status").json()["usage_accounting"]
                if usage["spooled_batches"] == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert usage["spooled_batches"] == 0 and usage["spool_files_set_aside"] == 1
            assert usage["spool_dir"] == str(spool_dir)
            totals = again.registry.usage_report(tenant="acme").totals  # the database, before any flush by a read
            assert {name: totals[name] for name in sums} == sums
            assert admin.get("/admin/v1/usage", params={"tenant": "acme"}).json()["totals"]["requests"] == 6
            metrics = admin.get("/metrics").text
        assert "loraplex_usage_spooled_batches 0.0" in metrics
        assert "loraplex_usage_spool_files_set_aside_total 1.0" in metrics
        assert sorted(p.name for p in spool_dir.iterdir()) == ["torn.json.bad"]
    finally:
        again.stop()
    assert again.registry.usage_report(tenant="acme").totals["requests"] == 6  # not counted twice
