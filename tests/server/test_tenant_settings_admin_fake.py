"""``PATCH /admin/v1/tenants/{t}`` and the tenant GETs: the HTTP contract of per-tenant
``max_concurrent_requests``, ``scheduling_weight``, ``max_requests_per_minute`` and
``max_tokens_per_minute``, checked against the database and the audit log; bad input is a 400
naming the field that changes nothing."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import start_server

DEFAULTS = {"max_concurrent_requests": None, "scheduling_weight": 1.0}
RATES = ("max_requests_per_minute", "max_tokens_per_minute")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("tenant-settings"))
    for name in ("acme", "globex", "batch"):
        server.registry.create_tenant(name)
    yield server
    server.stop()


def _settings(tenant: dict) -> dict:
    return {k: tenant[k] for k in DEFAULTS}


def _stored(srv, name: str) -> dict:
    info = srv.registry.get_tenant(name)
    return {"max_concurrent_requests": info.max_concurrent_requests, "scheduling_weight": info.scheduling_weight}


def test_tenants_show_their_settings_and_patch_changes_them(srv):
    with srv.admin() as c:
        listed = {t["name"]: _settings(t) for t in c.get("/admin/v1/tenants").json()["data"]}
        assert listed["globex"] == DEFAULTS
        r = c.patch("/admin/v1/tenants/globex", json={"scheduling_weight": 2})
        assert r.status_code == 200 and r.json()["name"] == "globex"
        assert _settings(r.json()) == {"max_concurrent_requests": None, "scheduling_weight": 2.0}
        assert _stored(srv, "globex") == _settings(r.json())

        r = c.patch("/admin/v1/tenants/globex", json={"max_concurrent_requests": 3, "scheduling_weight": 0.25})
        assert _settings(r.json()) == {"max_concurrent_requests": 3, "scheduling_weight": 0.25}
        one = c.get("/admin/v1/tenants/globex")
        assert one.status_code == 200 and _settings(one.json()) == _settings(r.json())
        assert one.json()["created_at"] and one.json()["name"] == "globex"
        listed = {t["name"]: _settings(t) for t in c.get("/admin/v1/tenants").json()["data"]}
        assert listed["globex"] == {"max_concurrent_requests": 3, "scheduling_weight": 0.25}
        assert listed["acme"] == DEFAULTS  # the others untouched

        r = c.patch("/admin/v1/tenants/globex", json={"max_concurrent_requests": None})  # back to the default
        assert _settings(r.json()) == {"max_concurrent_requests": None, "scheduling_weight": 0.25}
        assert _stored(srv, "globex") == _settings(r.json())

        events = c.get("/admin/v1/audit", params={"tenant": "globex"}).json()["data"]
    updates = [(e["action"], e["actor"], e["object_type"], e["object_name"], e["detail"])
               for e in events if e["action"] == "tenant.update"]
    assert updates == [
        ("tenant.update", "admin", "tenant", "globex", {"max_concurrent_requests": {"from": 3, "to": None}}),
        ("tenant.update", "admin", "tenant", "globex",
         {"max_concurrent_requests": {"from": None, "to": 3}, "scheduling_weight": {"from": 2.0, "to": 0.25}}),
        ("tenant.update", "admin", "tenant", "globex", {"scheduling_weight": {"from": 1.0, "to": 2.0}}),
    ]


BAD = [
    ({"max_concurrent_requests": 0}, "max_concurrent_requests"),
    ({"max_concurrent_requests": 100_001}, "max_concurrent_requests"),
    ({"max_concurrent_requests": 1.5}, "max_concurrent_requests"),
    ({"max_concurrent_requests": "2"}, "max_concurrent_requests"),
    ({"max_concurrent_requests": True}, "max_concurrent_requests"),
    ({"scheduling_weight": 0}, "scheduling_weight"),
    ({"scheduling_weight": -1}, "scheduling_weight"),
    ({"scheduling_weight": 1000}, "scheduling_weight"),
    ({"scheduling_weight": 0.001}, "scheduling_weight"),
    ({"scheduling_weight": None}, "scheduling_weight"),
    ({"scheduling_weight": "2"}, "scheduling_weight"),
    ({"scheduling_weight": 10**400}, "scheduling_weight"),  # no float holds it: a 400, not a 500
    ({"scheduling_weight": -10**400}, "scheduling_weight"),
    ({"scheduling_weight": 2, "max_concurrent_requests": -1}, "max_concurrent_requests"),  # nothing applied
    ({"max_requests_per_minute": 0}, "max_requests_per_minute"),
    ({"max_requests_per_minute": 2.5}, "max_requests_per_minute"),
    ({"max_requests_per_minute": "60"}, "max_requests_per_minute"),
    ({"max_requests_per_minute": 10**400}, "max_requests_per_minute"),
    ({"max_tokens_per_minute": -5}, "max_tokens_per_minute"),
    ({"max_tokens_per_minute": 1_000_000_001}, "max_tokens_per_minute"),
    ({"max_tokens_per_minute": False}, "max_tokens_per_minute"),
    ({"max_requests_per_minute": 5, "max_tokens_per_minute": {}}, "max_tokens_per_minute"),  # nothing applied
    ({"max_tokens": 5}, "max_tokens"),
    ({"priority": 1}, "priority"),  # an unknown field is named, not ignored
    ({}, None),
]


@pytest.mark.parametrize("body,param", BAD)
def test_bad_values_are_400s_naming_the_field_and_change_nothing(srv, body, param):
    with srv.admin() as c:
        before = c.get("/admin/v1/audit", params={"tenant": "batch"}).json()["data"]
        r = c.patch("/admin/v1/tenants/batch", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
        if param:
            assert param in error["message"]
        assert c.get("/admin/v1/audit", params={"tenant": "batch"}).json()["data"] == before
    assert _stored(srv, "batch") == DEFAULTS and _rates(srv, "batch") == (None, None)


@pytest.mark.parametrize("content", [b"[1]", b'"x"', b"{nope", b'{"scheduling_weight": NaN}'])
def test_a_body_that_is_not_a_json_object_is_a_400(srv, content):
    with srv.admin() as c:
        r = c.patch("/admin/v1/tenants/batch", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    assert _stored(srv, "batch") == DEFAULTS


def test_unknown_tenant_is_a_404_and_admin_key_is_required(srv):
    with srv.admin() as c:
        for r in (c.patch("/admin/v1/tenants/nobody", json={"scheduling_weight": 2}),
                  c.get("/admin/v1/tenants/nobody")):
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert c.patch("/admin/v1/tenants/..bad", json={"scheduling_weight": 2}).status_code == 400
    with httpx.Client(base_url=srv.url) as anonymous:
        r = anonymous.patch("/admin/v1/tenants/acme", json={"scheduling_weight": 50})
        assert r.status_code == 401
        assert anonymous.get("/admin/v1/tenants/acme").status_code == 401
    assert _stored(srv, "acme") == DEFAULTS


def _rates(srv, name: str) -> tuple:
    info = srv.registry.get_tenant(name)
    return info.max_requests_per_minute, info.max_tokens_per_minute


def test_rate_limits_are_shown_set_made_unlimited_and_audited(srv):
    srv.registry.create_tenant("rated")
    with srv.admin() as c:
        listed = {t["name"]: t for t in c.get("/admin/v1/tenants").json()["data"]}
        assert {k: listed["rated"][k] for k in RATES} == {k: None for k in RATES}  # unlimited by default
        r = c.patch("/admin/v1/tenants/rated", json={"max_requests_per_minute": 60, "max_tokens_per_minute": 90_000})
        assert r.status_code == 200
        assert {k: r.json()[k] for k in RATES} == {"max_requests_per_minute": 60, "max_tokens_per_minute": 90_000}
        assert _settings(r.json()) == DEFAULTS  # the other settings untouched
        assert _rates(srv, "rated") == (60, 90_000)
        one = c.get("/admin/v1/tenants/rated").json()
        assert (one["max_requests_per_minute"], one["max_tokens_per_minute"]) == (60, 90_000)
        r = c.patch("/admin/v1/tenants/rated", json={"max_requests_per_minute": None})
        assert r.json()["max_requests_per_minute"] is None and _rates(srv, "rated") == (None, 90_000)
        events = c.get("/admin/v1/audit", params={"tenant": "rated"}).json()["data"]
    assert [e["detail"] for e in events if e["action"] == "tenant.update"] == [
        {"max_requests_per_minute": {"from": 60, "to": None}},
        {"max_requests_per_minute": {"from": None, "to": 60}, "max_tokens_per_minute": {"from": None, "to": 90_000}},
    ]
