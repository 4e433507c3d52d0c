"""Per-tenant metrics: requests, tokens and TTFT by tenant (base model and adapters together),
checked against the usage the HTTP answers report, and the requests each tenant has in flight
while a stream runs; the tenant label set stays bounded."""

from __future__ import annotations

import re
import threading
import time

import httpx

from tests.server.fakes import FakeEngine


def _metric(text: str, name: str, **labels) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def _scrape(url: str) -> str:
    return httpx.get(url + "/metrics").text


def test_tokens_requests_and_ttft_per_tenant(fake_server):
    keys = {t: fake_server.make_tenant(t) for t in ("acme", "globex")}
    usage = {"acme": [0, 0], "globex": [0, 0]}
    for tenant, path, body in (
        ("acme", "/v1/completions", {"prompt": "abc", "max_tokens": 3}),
        ("acme", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5}),
        ("globex", "/v1/completions", {"prompt": "a longer prompt", "max_tokens": 2}),
    ):
        with fake_server.tenant_client(keys[tenant]) as c:
            r = c.post(path, json={"model": "fake-model", **body})
        assert r.status_code == 200
        usage[tenant][0] += r.json()["usage"]["prompt_tokens"]
        usage[tenant][1] += r.json()["usage"]["completion_tokens"]
    text = _scrape(fake_server.url)
    for tenant, (prompt, generation) in usage.items():
        assert _metric(text, "loraplex_tenant_tokens_total", tenant=tenant, kind="prompt") == prompt
        assert _metric(text, "loraplex_tenant_tokens_total", tenant=tenant, kind="generation") == generation
    assert _metric(text, "loraplex_tenant_requests_total", tenant="acme") == 2
    assert _metric(text, "loraplex_tenant_requests_total", tenant="globex") == 1
    assert _metric(text, "loraplex_tenant_time_to_first_token_seconds_count", tenant="acme") == 2
    assert _metric(text, "loraplex_tenant_requests_in_flight", tenant="acme", state="running") is None


def test_in_flight_per_tenant_while_streaming(server_factory):
    engine = FakeEngine(step_seconds=0.05, max_model_len=4096)
    srv = server_factory(engine)
    key = srv.make_tenant("acme")
    done = threading.Event()

    def stream():
        with srv.tenant_client(key) as c:
            with c.stream("POST", "/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 60,
                                                           "stream": True}) as r:
                for _ in r.iter_lines():
                    pass
        done.set()

    thread = threading.Thread(target=stream)
    thread.start()
    deadline = time.monotonic() + 5
    running = None
    while running is None and time.monotonic() < deadline:
        running = _metric(_scrape(srv.url), "loraplex_tenant_requests_in_flight", tenant="acme", state="running")
        time.sleep(0.02)
    assert running == 1
    assert done.wait(10)
    thread.join()
    text = _scrape(srv.url)
    assert _metric(text, "loraplex_tenant_requests_in_flight", tenant="acme", state="running") is None
    assert _metric(text, "loraplex_tenant_requests_total", tenant="acme") == 1


def test_tenant_label_set_is_bounded():
    from loraplex.server.metrics import OTHER_LABEL, ServerMetrics

    m = ServerMetrics("m", 4, max_adapter_labels=2)
    for i in range(5):
        m.request_started(None, f"t{i}")
    assert m.tenant_states()["waiting"] == {"t0": 1, "t1": 1, OTHER_LABEL: 3}
    for i in range(5):
        m.request_finished(None, got_first_token=False, prompt_tokens=1, gen_tokens=0, e2e=None,
                           finish_reason=None, tenant=f"t{i}")
    assert m.tenant_states()["waiting"] == {}
