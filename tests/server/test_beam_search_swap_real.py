"""A beam search whose adapter's active version is swapped mid-search (the admin API's
``PUT .../active`` while its step requests run) finishes on the version it started with: its
beams equal those of the same body sent to that version by name (``sql@N``), never a mix; the
next search runs the newly active one."""

from __future__ import annotations

import io
import threading

from tests.fixtures.peft_adapters import make_peft_adapter
from tests.server.test_beam_search_http_real import FILES, PROMPT, world  # noqa: F401
from tests.server.test_disconnect_fake import _wait


# long enough that the admin API's swap lands mid-search also on a loaded machine (at 40 steps a
# CI run under load once saw the search end before the swap)
SEARCH_STEPS = 160


def test_a_search_stays_on_its_version_across_swaps(world, tmp_path):
    srv, key, engine, refs = world
    body = {"model": "sql", "prompt": PROMPT, "use_beam_search": True, "n": 2, "max_tokens": SEARCH_STEPS,
            "ignore_eos": True}
    v2 = make_peft_adapter(refs[None], tmp_path / "v2", seed=99, target_modules=["q_proj", "v_proj", "down_proj"])
    with srv.admin() as c:
        files = {f: (f, io.BytesIO((v2 / f).read_bytes())) for f in FILES}
        assert c.post("/admin/v1/tenants/acme/adapters/sql/versions", files=files).status_code == 201
        assert c.put("/admin/v1/tenants/acme/adapters/sql/active", json={"version": 1}).status_code == 200
    with srv.tenant_client(key) as c:
        by_version = {v: c.post("/v1/completions", json={**body, "model": f"sql@{v}"}).json()["choices"] for v in (1, 2)}
    assert by_version[1] != by_version[2]

    active = 1
    for swap_to in (2, 1, 2):
        result = {}

        def search():
            with srv.tenant_client(key) as c:
                result["r"] = c.post("/v1/completions", json=body)

        steps = engine.stats()["num_steps"]
        thread = threading.Thread(target=search)
        thread.start()
        _wait(lambda: engine.stats()["num_steps"] > steps + 5, 10.0)  # the search is under way
        with srv.admin() as c:
            assert c.put("/admin/v1/tenants/acme/adapters/sql/active", json={"version": swap_to}).status_code == 200
        swapped_at = engine.stats()["num_steps"] - steps
        thread.join()
        assert swapped_at < SEARCH_STEPS  # the swap came before the search's last step
        assert result["r"].status_code == 200, result["r"].text
        assert result["r"].json()["choices"] == by_version[active], swap_to
        active = swap_to


def test_a_search_whose_adapter_is_deleted_mid_search_finishes_on_it(world):
    """Between two steps no engine request holds the adapter; the request's own hold on the
    version (taken when its model was resolved) keeps it servable until the search ends."""
    srv, key, engine, _ = world
    body = {"model": "sql", "prompt": PROMPT, "use_beam_search": True, "n": 2, "max_tokens": 40, "ignore_eos": True}
    with srv.tenant_client(key) as c:
        want = c.post("/v1/completions", json=body).json()["choices"]
    result = {}

    def search():
        with srv.tenant_client(key) as c:
            result["r"] = c.post("/v1/completions", json=body)

    steps = engine.stats()["num_steps"]
    thread = threading.Thread(target=search)
    thread.start()
    _wait(lambda: engine.stats()["num_steps"] > steps + 5, 10.0)
    with srv.admin() as c:
        assert c.delete("/admin/v1/tenants/acme/adapters/sql").status_code == 200
    thread.join()
    assert result["r"].status_code == 200, result["r"].text
    assert result["r"].json()["choices"] == want
    with srv.tenant_client(key) as c:
        gone = c.post("/v1/completions", json=body)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
