"""vLLM's request ``priority`` and the caller's tenant reach the engine from every generating
route; a priority the scheduling policy would ignore (fcfs), or one that is not a bounded
integer, is a 400 naming ``priority`` that starts nothing."""

from __future__ import annotations

import pytest

from tests.server.conftest import start_server

CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
COMPLETION = ("/v1/completions", {"prompt": [5, 6, 7]})
RESPONSES = ("/v1/responses", {"input": "hi"})


@pytest.fixture(scope="module", params=["fair", "fcfs"])
def world(request, tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp(f"prio-{request.param}"), scheduling_policy=request.param)
    keys = {t: srv.make_tenant(t) for t in ("acme", "globex")}
    yield request.param, srv, keys
    srv.stop()


def _post(srv, key: str, path: str, body: dict):
    engine = srv.engine
    before = set(engine.scheduling_seen)
    with srv.tenant_client(key) as c:
        limit = {"max_output_tokens": 2} if path == "/v1/responses" else {"max_tokens": 2}
        r = c.post(path, json={"model": srv.app.state.ctx.served_model_name, **limit, **body})
    new = [engine.scheduling_seen[rid] for rid in engine.scheduling_seen if rid not in before]
    return r, new


@pytest.mark.parametrize("path,body", [CHAT, COMPLETION, RESPONSES])
def test_priority_and_tenant_reach_the_engine(world, path, body):
    policy, srv, keys = world
    r, seen = _post(srv, keys["globex"], path, body)
    assert r.status_code == 200 and seen == [(0, "globex")]
    r, seen = _post(srv, keys["acme"], path, {**body, "priority": -3})
    if policy == "fcfs":
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority" and seen == []
        assert "--scheduling-policy" in r.json()["error"]["message"]
    else:
        assert r.status_code == 200 and seen == [(-3, "acme")]


def test_lorax_generate_carries_the_tenant(world):
    _, srv, keys = world
    r, seen = _post(srv, keys["acme"], "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200 and seen == [(0, "acme")]


@pytest.mark.parametrize("bad", ["1", 1.5, True, [1], 1 << 31, -(1 << 31)])
@pytest.mark.parametrize("path,body", [CHAT, COMPLETION])
def test_bad_priority_is_a_400_naming_it(world, bad, path, body):
    _, srv, keys = world
    r, seen = _post(srv, keys["acme"], path, {**body, "priority": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert seen == []
