"""LoRAX's ``merged_adapters`` over HTTP (fake engine, real registry and AdapterManager with a
local blob store and disk cache): the adapter the engine is handed holds PEFT's
``add_weighted_adapter`` merge of the versions the ids resolve to; the answer has LoRAX's shape
(``x-adapter-id`` is the ids joined by commas, as LoRAX names a merge), streamed too; the same
request reuses the merge, a hot-swapped or deleted constituent never serves the old merge; every
refusal is a 4xx in LoRAX's error shape that builds, caches and starts nothing."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from loraplex.registry.adapter_manager import AdapterManager
from loraplex.storage.base import open_blob_store
from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for, spec_for, tiny_llama
from tests.server.conftest import start_server
from tests.server.fakes import FakeEngine, expected_text

MAX_RANK = 16


@pytest.fixture(scope="module")
def peft(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    base = tiny_llama(seed=11)
    dirs = {
        "x": make_peft_adapter(base, root / "x", seed=1, r=4),
        "y": make_peft_adapter(base, root / "y", seed=2, r=4, lora_alpha=3, target_modules=["q_proj", "k_proj", "o_proj"]),
        "y2": make_peft_adapter(base, root / "y2", seed=3, r=4, lora_alpha=3, target_modules=["q_proj", "k_proj"]),
        "r8": make_peft_adapter(base, root / "r8", seed=4, r=8),
    }
    return base, spec_for(base), dirs


@pytest.fixture(scope="module")
def world(tmp_path_factory, peft):
    base, spec, dirs = peft
    tmp = tmp_path_factory.mktemp("srv")
    blobs = open_blob_store(str(tmp / "blobs"))

    def make_adapters(registry, home):
        return AdapterManager(registry, blobs, AdapterManager.make_disk_cache(home / "adapter-cache", 1 << 30),
                              spec, MAX_RANK)

    srv = start_server(tmp, FakeEngine(), make_adapters)
    key = srv.make_tenant("acme")
    srv.make_tenant("other")
    for name in ("x", "y"):
        srv.adapters.upload("acme", name, dirs[name], "admin")
    srv.adapters.upload("acme", "r8", dirs["r8"], "admin")
    srv.adapters.upload("other", "theirs", dirs["x"], "admin")
    # an adapter recorded for another base model (same shapes): the registry says so
    elsewhere = AdapterManager(srv.registry, blobs, srv.adapters.disk_cache, replace(spec, model_name="other-base"), MAX_RANK)
    elsewhere.upload("acme", "foreign", dirs["x"], "admin")
    with srv.tenant_client(key) as client:
        yield srv, client
    srv.stop()


def _merger(srv):
    return srv.app.state.ctx.merges


def _peft_merge(base, dirs: dict, weights, strategy, **kw) -> dict:
    """PEFT's merged tensors, named as PEFT saves them."""
    model = peft_model_for(copy.deepcopy(base), dirs)
    model.add_weighted_adapter(list(dirs), weights, "m", combination_type=strategy, **kw)
    return {n.replace(".m.", "."): p.detach() for n, p in model.named_parameters() if ".m." in n and p.abs().sum() > 0}


def _served_tensors(srv, content_hash: str) -> dict:
    return load_file(str(srv.adapters.disk_cache.path_of(content_hash) / "adapter_model.safetensors"))


def _gen(client, merged, path="/t/acme/generate", **params):
    return client.post(path, json={"inputs": "hello world", "parameters": {"merged_adapters": merged,
                                                                          "max_new_tokens": 6, **params}})


def _assert_same(mine: dict, theirs: dict) -> None:
    assert set(mine) == set(theirs)
    for name in mine:
        torch.testing.assert_close(mine[name], theirs[name], rtol=1e-5, atol=1e-6)


def test_merge_served_reused_streamed(world, peft):
    srv, client = world
    base, _, dirs = peft
    merged = {"ids": ["x", "y"], "weights": [0.6, 1.3], "merge_strategy": "ties", "density": 0.5,
              "majority_sign_method": "frequency"}
    builds = _merger(srv).builds
    r = _gen(client, merged, details=True)
    assert r.status_code == 200, r.text
    _, merged_hash = srv.engine.started[-1]
    assert merged_hash not in {v.sha256 for v in (srv.registry.resolve("acme", "x"), srv.registry.resolve("acme", "y"))}
    _assert_same(_served_tensors(srv, merged_hash), _peft_merge(base, {"x": dirs["x"], "y": dirs["y"]}, [0.6, 1.3],
                                                               "ties", density=0.5, majority_sign_method="frequency"))
    tok = srv.engine.tokenizer
    assert r.json()["generated_text"] == expected_text(tok, tok("hello world")["input_ids"], merged_hash, None, 6)
    assert r.headers["x-adapter-id"] == "x,y"
    assert _merger(srv).builds == builds + 1

    # the same merge again (any route, streamed too): no new build, the same adapter
    again = _gen(client, merged)
    events = [json.loads(line[5:]) for line in _gen(client, merged, path="/t/acme/generate_stream").text.splitlines()
              if line.startswith("data:")]
    assert again.json()["generated_text"] == events[-1]["generated_text"] == r.json()["generated_text"]
    assert [h for _, h in srv.engine.started[-2:]] == [merged_hash, merged_hash]
    assert _merger(srv).builds == builds + 1 and _merger(srv).reuses >= 2
    # other weights are another merge
    assert _gen(client, {**merged, "weights": [0.6, 1.2]}).status_code == 200
    assert srv.engine.started[-1][1] != merged_hash and _merger(srv).builds == builds + 2
    assert srv.adapters.stats()["in_use"] == {}  # every request gave back its merge


def test_swap_and_delete_of_a_constituent(world, peft):
    srv, client = world
    base, _, dirs = peft
    srv.adapters.upload("acme", "swap", dirs["y"], "admin")
    merged = {"ids": ["x", "swap"], "weights": [1.0, 0.5]}  # linear by default
    assert _gen(client, merged).status_code == 200
    old_hash = srv.engine.started[-1][1]
    _assert_same(_served_tensors(srv, old_hash), _peft_merge(base, {"x": dirs["x"], "y": dirs["y"]}, [1.0, 0.5], "linear"))

    v2, _ = srv.adapters.upload("acme", "swap", dirs["y2"], "admin")
    with srv.admin() as admin:
        assert admin.put("/admin/v1/tenants/acme/adapters/swap/active", json={"version": v2.version}).status_code == 200
    assert _gen(client, merged).status_code == 200
    new_hash = srv.engine.started[-1][1]
    assert new_hash != old_hash
    _assert_same(_served_tensors(srv, new_hash), _peft_merge(base, {"x": dirs["x"], "y2": dirs["y2"]}, [1.0, 0.5], "linear"))
    # name@N still names the old version, and its merge is the cached one
    builds = _merger(srv).builds
    assert _gen(client, {**merged, "ids": ["x", "swap@1"]}).status_code == 200
    assert srv.engine.started[-1][1] == old_hash and _merger(srv).builds == builds

    cache = srv.adapters.disk_cache
    assert cache.contains(old_hash) and cache.contains(new_hash)
    with srv.admin() as admin:
        assert admin.delete("/admin/v1/tenants/acme/adapters/swap").status_code in (200, 204)
    # the merge of the deleted weights leaves the disk cache and the engine; swap@1's weights
    # are still adapter `y`'s, so their merge stays
    assert not cache.contains(new_hash) and new_hash in srv.engine.unloaded
    # and its engine record and names (nothing can name it again)
    assert new_hash in srv.engine.forgotten and new_hash not in srv.app.state.ctx.adapter_display
    assert old_hash not in srv.engine.forgotten and old_hash in srv.app.state.ctx.adapter_display
    assert cache.contains(old_hash) and old_hash not in srv.engine.unloaded
    started = len(srv.engine.started)
    for ids in (["x", "swap"], ["x", "swap@1"]):
        r = _gen(client, {**merged, "ids": ids})
        assert r.status_code == 404 and r.json() == {
            "error": f"Adapter `{ids[1]}` does not exist or you do not have access to it.", "error_type": "not_found"}
    assert len(srv.engine.started) == started


@pytest.mark.parametrize("params, status, words", [
    ({"merged_adapters": {"ids": ["x", "nope"], "weights": [1, 1]}}, 404, "Adapter `nope` does not exist"),
    ({"merged_adapters": {"ids": ["x", "theirs"], "weights": [1, 1]}}, 404, "Adapter `theirs` does not exist"),
    ({"merged_adapters": {"ids": ["x", "Bad Name!"]}}, 404, "Adapter `Bad Name!` does not exist"),
    ({"merged_adapters": {"ids": ["x", "y"], "weights": [1]}}, 422, "same length"),
    ({"merged_adapters": {"ids": ["x", "y"], "weights": [1, "2"]}}, 422, "finite numbers"),
    ({"merged_adapters": {"ids": [], "weights": []}}, 422, "non-empty list"),
    ({"merged_adapters": ["x", "y"]}, 422, "must be an object"),
    ({"merged_adapters": {"ids": ["x", "y"], "merge_strategy": "svd"}}, 422, "`merge_strategy` must be one of"),
    ({"merged_adapters": {"ids": ["x", "y"], "merge_strategy": "ties"}}, 422, "`density` in (0, 1] is required"),
    ({"merged_adapters": {"ids": ["x", "y"], "merge_strategy": "dare_ties", "density": 0}}, 422, "is required"),
    ({"merged_adapters": {"ids": ["x", "y"], "merge_strategy": "ties", "density": 1.5}}, 422, "`density` must be"),
    ({"merged_adapters": {"ids": ["x", "y"], "merge_strategy": "ties", "density": 0.5,
                          "majority_sign_method": "median"}}, 422, "`majority_sign_method` must be one of"),
    ({"merged_adapters": {"ids": ["x", "y"]}, "adapter_id": "x"}, 422, "at most one of `adapter_id`"),
    ({"merged_adapters": {"ids": ["x", "r8"]}}, 422, "different ranks"),
    ({"merged_adapters": {"ids": ["x", "foreign"]}}, 422, "different base models"),
])
def test_refusals_build_and_start_nothing(world, params, status, words):
    srv, client = world
    cache = srv.adapters.disk_cache
    before = (_merger(srv).stats(), cache.stats()["entries"], len(srv.engine.started))
    for path in ("/t/acme/generate", "/t/acme/generate_stream", "/t/acme"):
        r = client.post(path, json={"inputs": "hi", "parameters": {"max_new_tokens": 2, **params}})
        assert r.status_code == status, r.text
        body = r.json()
        assert set(body) == {"error", "error_type"} and words in body["error"], body
        assert body["error_type"] == ("not_found" if status == 404 else "validation")
        if status == 422:
            assert "`merged_adapters`" in body["error"]
    assert (_merger(srv).stats(), cache.stats()["entries"], len(srv.engine.started)) == before
    assert srv.adapters.stats()["in_use"] == {}


@pytest.mark.parametrize("weight", [b"1e400", b"1" + b"0" * 400, b"-1" + b"0" * 400])
def test_infinite_weight_is_refused(world, weight):
    """1e400 reads as inf; 10**400 written out is an int no float holds (it was a 500)."""
    srv, client = world
    before = (_merger(srv).stats(), srv.adapters.disk_cache.stats()["entries"], len(srv.engine.started))
    raw = b'{"inputs": "hi", "parameters": {"merged_adapters": {"ids": ["x", "y"], "weights": [1, %s]}}}' % weight
    r = client.post("/t/acme/generate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422 and "finite numbers" in r.json()["error"], r.text
    assert (_merger(srv).stats(), srv.adapters.disk_cache.stats()["entries"], len(srv.engine.started)) == before


def test_distinct_merges_are_bounded_per_tenant(world, peft):
    """Every other weight is another merge; past the tenant's bound the least recently used are
    forgotten: out of the disk cache, the status page's names and (``forget_adapters``) the
    engine, so ever new weights cannot grow the server. Asked again, one is built again with the
    same weights. The bound is per tenant: another tenant's merges stay."""
    srv, client = world
    merger, ctx, cache = _merger(srv), srv.app.state.ctx, srv.adapters.disk_cache
    saved = merger.max_per_tenant
    merger.max_per_tenant = 2
    try:
        srv.adapters.upload("other", "theirs2", peft[2]["y"], "admin")
        _, other_key = srv.registry.create_api_key("other")
        with srv.tenant_client(other_key) as other:
            r = _gen(other, {"ids": ["theirs", "theirs2"], "weights": [0.5, 0.5]}, path="/t/other/generate")
        assert r.status_code == 200, r.text
        theirs = srv.engine.started[-1][1]
        hashes = []
        for i in range(5):
            assert _gen(client, {"ids": ["x", "y"], "weights": [1.0, 0.13 * (i + 1)]}).status_code == 200
            hashes.append(srv.engine.started[-1][1])
        assert len(set(hashes)) == 5
        assert merger.remembered_hashes() == set(hashes[-2:]) | {theirs}
        for h in hashes[:3]:
            assert not cache.contains(h) and h not in ctx.adapter_display and h not in ctx.metrics.hash_labels
            assert h in srv.engine.forgotten
        for h in hashes[-2:] + [theirs]:
            assert cache.contains(h) and h in ctx.adapter_display and h not in srv.engine.forgotten
        builds = merger.builds
        assert _gen(client, {"ids": ["x", "y"], "weights": [1.0, 0.13]}).status_code == 200
        assert srv.engine.started[-1][1] == hashes[0] and merger.builds == builds + 1
        assert hashes[0] in ctx.adapter_display and cache.contains(hashes[0])
        assert srv.adapters.stats()["in_use"] == {}
    finally:
        merger.max_per_tenant = saved


def test_a_request_admission_refuses_builds_no_merge(world, peft):
    """A merge is built before admission takes its slots; a request the tenant's limits (requests
    per minute, concurrency cap) or a draining server refuse gets the same LoRAX answer as
    without a merge (429 ``overloaded``, 503 ``unavailable``) and builds, caches and forgets
    nothing: the tenant's remembered merges are left as they were."""
    srv, _ = world
    dirs = peft[2]
    srv.registry.create_tenant("limited")
    _, key = srv.registry.create_api_key("limited")
    for name in ("x", "y"):
        srv.adapters.upload("limited", name, dirs[name], "admin")
    merger, ctx, cache = _merger(srv), srv.app.state.ctx, srv.adapters.disk_cache
    with srv.admin() as admin:
        assert admin.patch("/admin/v1/tenants/limited", json={"max_requests_per_minute": 1}).status_code == 200
    with srv.tenant_client(key) as client:
        assert _gen(client, {"ids": ["x", "y"], "weights": [1.0, 0.21]}, path="/t/limited/generate").status_code == 200
        before = (merger.stats(), cache.stats()["entries"], len(srv.engine.started))
        r = _gen(client, {"ids": ["x", "y"], "weights": [1.0, 0.22]}, path="/t/limited/generate")
        assert r.status_code == 429 and r.json()["error_type"] == "overloaded", r.text
        assert (merger.stats(), cache.stats()["entries"], len(srv.engine.started)) == before
        with srv.admin() as admin:
            assert admin.patch("/admin/v1/tenants/limited", json={"max_requests_per_minute": None,
                                                                   "max_concurrent_requests": 1}).status_code == 200
        ctx.tenant_limits.forget("limited")
        ctx.limiter.acquire("limited", 1)  # one request in flight: the cap is reached
        try:
            r = _gen(client, {"ids": ["x", "y"], "weights": [1.0, 0.23]}, path="/t/limited/generate")
        finally:
            ctx.limiter.release("limited")
        assert r.status_code == 429 and r.json()["error_type"] == "overloaded", r.text
        with srv.admin() as admin:
            assert admin.patch("/admin/v1/tenants/limited", json={"max_concurrent_requests": None}).status_code == 200
        ctx.tenant_limits.forget("limited")
        ctx.lifecycle.draining = True
        try:
            r = _gen(client, {"ids": ["x", "y"], "weights": [1.0, 0.24]}, path="/t/limited/generate")
        finally:
            ctx.lifecycle.draining = False
        assert r.status_code == 503 and r.json()["error_type"] == "unavailable", r.text
        assert (merger.stats(), cache.stats()["entries"], len(srv.engine.started)) == before
    assert srv.adapters.stats()["in_use"] == {} and ctx.limiter.in_flight("limited") == 0


def test_identical_merges_asked_at_once_are_built_once(world):
    """Many requests for one new merge at the same moment: one build, every one on its files."""
    from concurrent.futures import ThreadPoolExecutor

    from loraplex.lora.merge import MergeParams

    srv, _ = world
    merger = _merger(srv)
    builds = merger.builds
    params = MergeParams("dare_ties", (0.9, 0.35), 0.6, "total")
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: merger.resolve("acme", ["x", "y"], params), range(8)))
    try:
        assert merger.builds == builds + 1 and sum(m.built for m in got) == 1
        assert len({m.ref.content_hash for m in got}) == 1
        assert srv.adapters.in_use(got[0].ref.content_hash) == 8  # each holds it
    finally:
        for m in got:
            srv.adapters.release(m.ref.content_hash)


def test_a_tenant_builds_one_merge_at_a_time(world, monkeypatch):
    """A build takes CPU and host memory (up to 16 adapters in float32): while one of a tenant's
    merges is built, another merge of that tenant is LoRAX's 429 ``overloaded`` (Retry-After) that
    builds nothing; the same merge waits for that build and reuses it; other tenants build."""
    import threading

    from loraplex.registry import adapter_merges

    srv, client = world
    merger, cache = _merger(srv), srv.adapters.disk_cache
    release, entered = threading.Event(), threading.Event()
    real = adapter_merges.merge_adapters

    def slow_merge(parts, params, seed):
        if params.weights == (1.0, 0.41):
            entered.set()
            assert release.wait(30)
        return real(parts, params, seed)

    monkeypatch.setattr(adapter_merges, "merge_adapters", slow_merge)
    slow = {"ids": ["x", "y"], "weights": [1.0, 0.41]}
    answers = []
    first = threading.Thread(target=lambda: answers.append(_gen(client, slow)))
    first.start()
    try:
        assert entered.wait(30)
        builds, entries = merger.builds, cache.stats()["entries"]
        r = _gen(client, {"ids": ["x", "y"], "weights": [1.0, 0.42]})
        assert r.status_code == 429 and r.json()["error_type"] == "overloaded", r.text
        assert "being built" in r.json()["error"] and r.headers["retry-after"] == "1"
        assert (merger.builds, cache.stats()["entries"]) == (builds, entries)
        _, other_key = srv.registry.create_api_key("other")
        with srv.tenant_client(other_key) as other:  # another tenant is not held up
            assert _gen(other, {"ids": ["theirs"], "weights": [0.77]}, path="/t/other/generate").status_code == 200
        second = threading.Thread(target=lambda: answers.append(_gen(client, slow)))
        second.start()
    finally:
        release.set()
        first.join(30)
    second.join(30)
    assert [a.status_code for a in answers] == [200, 200]
    assert answers[0].json() == answers[1].json() and merger.builds == builds + 2  # the slow one, other's
    assert srv.adapters.stats()["in_use"] == {}


def test_identical_requests_wait_for_a_build_without_holding_threads(world, monkeypatch):
    """Requests for a merge being built wait on the event loop, not inside ``resolve`` on a
    thread-pool thread each (the pool every route's blocking work shares): one resolve at a time
    for that merge, then each finds it built."""
    import threading
    import time

    from loraplex.registry import adapter_merges

    srv, client = world
    merger = _merger(srv)
    release, entered = threading.Event(), threading.Event()
    real_merge, real_resolve = adapter_merges.merge_adapters, merger.resolve
    inside, most = [0], [0]
    lock = threading.Lock()

    def slow_merge(parts, params, seed):
        entered.set()
        assert release.wait(30)
        return real_merge(parts, params, seed)

    def counted_resolve(*args):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        try:
            return real_resolve(*args)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(adapter_merges, "merge_adapters", slow_merge)
    monkeypatch.setattr(merger, "resolve", counted_resolve)
    builds = merger.builds
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(_gen(client, {"ids": ["x", "y"], "weights": [1.0, 0.57]})))
               for _ in range(5)]
    threads[0].start()
    try:
        assert entered.wait(30)
        for t in threads[1:]:
            t.start()
        time.sleep(1.0)  # the four others have arrived and wait
        assert most[0] == 1
    finally:
        release.set()
        for t in threads:
            t.join(30)
    assert [a.status_code for a in answers] == [200] * 5 and len({a.text for a in answers}) == 1
    assert merger.builds == builds + 1 and most[0] == 1
    assert srv.adapters.stats()["in_use"] == {} and getattr(srv.app.state.ctx, "merges_resolving", {}) == {}


def test_a_failing_engine_forget_neither_fails_nor_leaks_the_request(world, monkeypatch):
    """Dropping forgotten merges is housekeeping: an engine that cannot forget them (stopping)
    leaves the request served and its merge released; they are tried again by a later request."""
    srv, client = world
    merger = _merger(srv)
    saved = merger.max_per_tenant
    merger.max_per_tenant = 1

    async def broken(adapter_ids):
        raise RuntimeError("engine stopped")

    try:
        assert _gen(client, {"ids": ["x", "y"], "weights": [1.0, 0.61]}).status_code == 200
        first = srv.engine.started[-1][1]
        monkeypatch.setattr(srv.engine, "forget_adapters", broken)
        assert _gen(client, {"ids": ["x", "y"], "weights": [1.0, 0.62]}).status_code == 200
        assert srv.adapters.stats()["in_use"] == {}
        monkeypatch.undo()
        assert _gen(client, {"ids": ["x", "y"], "weights": [1.0, 0.63]}).status_code == 200
        assert first in srv.engine.forgotten  # handed back, then dropped
    finally:
        merger.max_per_tenant = saved
