"""The salt each request's prefix-cache blocks carry: per tenant by default (a cache hit is
faster than a miss, so blocks shared across tenants would let one time another's prompts), the
request's vLLM ``cache_salt`` within its tenant, and only the request's salt with
``prefix_cache_scope="shared"``. Bad salts are a 400 naming ``cache_salt`` that starts nothing."""

from __future__ import annotations

import pytest

from tests.server.conftest import start_server


def _salts(srv, key: str, body: dict, path: str = "/v1/completions") -> tuple[int, str | None]:
    engine = srv.engine
    before = set(engine.salts_seen)
    with srv.tenant_client(key) as c:
        r = c.post(path, json={"model": srv.app.state.ctx.served_model_name, "max_tokens": 2, **body})
    new = [engine.salts_seen[rid] for rid in engine.salts_seen if rid not in before]
    return r.status_code, (new[0] if new else "<none>")


@pytest.fixture(scope="module", params=["tenant", "shared"])
def world(request, tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp(f"salt-{request.param}"), prefix_cache_scope=request.param)
    keys = {t: srv.make_tenant(t) for t in ("acme", "globex")}
    yield request.param, srv, keys
    srv.stop()


def test_salt_per_tenant_and_request(world):
    scope, srv, keys = world
    prompt = {"prompt": [5, 6, 7]}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    expect = {
        "tenant": {("acme", None): '["tenant", "acme", null]', ("globex", None): '["tenant", "globex", null]',
                   ("acme", "u1"): '["tenant", "acme", "u1"]', ("acme", 'x", "y'): '["tenant", "acme", "x\\", \\"y"]'},
        "shared": {("acme", None): None, ("globex", None): None, ("acme", "u1"): "u1", ("acme", 'x", "y'): 'x", "y'},
    }[scope]
    for (tenant, salt), wanted in expect.items():
        extra = {} if salt is None else {"cache_salt": salt}
        assert _salts(srv, keys[tenant], {**prompt, **extra}) == (200, wanted)
        assert _salts(srv, keys[tenant], {**chat, **extra}, "/v1/chat/completions") == (200, wanted)
    # LoRAX's generate runs through the same admission: the tenant's salt
    status, salt = _salts(srv, keys["globex"], {"inputs": "hi", "parameters": {"max_new_tokens": 2}}, "/generate")
    assert status == 200 and salt == expect[("globex", None)]


@pytest.mark.parametrize("bad", ["", 3, ["a"], {"k": "v"}, True])
def test_bad_salt_is_a_400_naming_it(world, bad):
    _, srv, keys = world
    with srv.tenant_client(keys["acme"]) as c:
        for path, body in (("/v1/completions", {"prompt": [5, 6]}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            before = len(srv.engine.started)
            r = c.post(path, json={"model": srv.app.state.ctx.served_model_name, "cache_salt": bad, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
            assert len(srv.engine.started) == before
