"""CORS (vLLM's --allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials)
against the Fetch standard's CORS protocol, over HTTP on a real server with a fake engine.

The rules checked: a preflight (OPTIONS with Origin and Access-Control-Request-Method) from an
allowed origin is answered with Access-Control-Allow-Origin naming it (or "*"), the method and
the requested headers allowed; an origin not allowed never gets Access-Control-Allow-Origin, so a
browser hides the answer; every actual answer to an allowed origin carries the header, errors
and streams included; with credentials the origin is named, never "*" (a browser refuses "*"
with credentials).
"""

from __future__ import annotations

import json

import httpx

ALLOWED = "https://app.example"
OTHER = "https://evil.example"
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def preflight(srv, path: str, origin: str, method: str = "POST", headers: str = "authorization, content-type"):
    return httpx.options(srv.url + path, headers={"Origin": origin, "Access-Control-Request-Method": method,
                                                  "Access-Control-Request-Headers": headers}, timeout=10)


def allowed_header_names(response) -> set[str]:
    return {h.strip().lower() for h in response.headers.get("access-control-allow-headers", "").split(",")}


def exposed_header_names(response) -> set[str]:
    return {h.strip().lower() for h in response.headers.get("access-control-expose-headers", "").split(",")}


def test_preflight_on_tenant_routes_allows_the_origin_the_method_and_the_headers(server_factory):
    srv = server_factory(allowed_origins=[ALLOWED])
    for path in ("/t/acme/v1/chat/completions", "/v1/completions", "/t/acme/generate_stream", "/admin/v1/tenants"):
        r = preflight(srv, path, ALLOWED)
        assert r.status_code == 200, (path, r.text)
        assert r.headers["access-control-allow-origin"] == ALLOWED
        assert "POST" in [m.strip() for m in r.headers["access-control-allow-methods"].split(",")]
        assert {"authorization", "content-type"} <= allowed_header_names(r)
        assert "origin" in r.headers.get("vary", "").lower()  # the answer differs per origin: caches must know
        assert "access-control-allow-credentials" not in r.headers  # vLLM's default: off


def test_an_origin_not_allowed_gets_no_allow_origin_on_preflight_or_answer(server_factory):
    srv = server_factory(allowed_origins=[ALLOWED])
    key = srv.make_tenant("acme")
    r = preflight(srv, "/t/acme/v1/chat/completions", OTHER)
    assert r.status_code >= 400
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(srv.url + "/t/acme/v1/models", headers={"Origin": OTHER, "Authorization": f"Bearer {key}"})
    assert r.status_code == 200  # the server answers; the browser hides it
    assert "access-control-allow-origin" not in r.headers


def test_answers_errors_and_streams_carry_the_header(server_factory):
    srv = server_factory(allowed_origins=[ALLOWED], max_body_bytes=4096)
    key = srv.make_tenant("acme")
    origin = {"Origin": ALLOWED}
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        auth = {**origin, "Authorization": f"Bearer {key}"}
        answers = {
            "ok": c.post("/t/acme/v1/chat/completions", json=CHAT, headers=auth),
            "401": c.post("/t/acme/v1/chat/completions", json=CHAT, headers={**origin, "Authorization": "Bearer nope"}),
            "400": c.post("/t/acme/v1/chat/completions", json={**CHAT, "max_tokens": "x"}, headers=auth),
            "404": c.get("/no/such/route", headers=origin),
            "413": c.post("/t/acme/v1/completions", content=b"{" + b" " * 8192 + b"}", headers=auth),
        }
        with c.stream("POST", "/t/acme/v1/chat/completions", json={**CHAT, "stream": True}, headers=auth) as s:
            stream_headers, body = s.headers, b"".join(s.iter_bytes())
    statuses = {name: r.status_code for name, r in answers.items()}
    assert statuses == {"ok": 200, "401": 401, "400": 400, "404": 404, "413": 413}
    for name, r in answers.items():
        assert r.headers.get("access-control-allow-origin") == ALLOWED, name
        # a script may read the id the answer carries (Fetch hides other headers from it)
        assert "x-request-id" in exposed_header_names(r) and r.headers.get("x-request-id"), name
    assert stream_headers.get("access-control-allow-origin") == ALLOWED
    assert {"x-request-id", "x-client-request-id", "retry-after", "x-ratelimit-remaining-requests"} \
        <= exposed_header_names(answers["ok"])
    assert body.rstrip().endswith(b"data: [DONE]")


def test_an_unhandled_error_answer_carries_the_header(server_factory):
    srv = server_factory(allowed_origins=[ALLOWED])

    def broken(*args, **kwargs):
        raise RuntimeError("registry bug")

    srv.registry.list_tenants = broken  # a 500 from Starlette's outermost error layer
    r = httpx.get(srv.url + "/admin/v1/tenants", headers={"Origin": ALLOWED, "Authorization": "Bearer test-admin-key"})
    assert r.status_code == 500
    assert r.headers.get("access-control-allow-origin") == ALLOWED
    assert json.loads(r.text)["error"]["code"] == "internal_error"


def test_without_allowed_origins_the_server_stays_same_origin(server_factory):
    srv = server_factory()
    r = preflight(srv, "/t/acme/v1/chat/completions", ALLOWED)
    assert r.status_code == 405  # no CORS layer: OPTIONS is no method of the route
    assert not [h for h in r.headers if h.lower().startswith("access-control-")]
    r = httpx.get(srv.url + "/health", headers={"Origin": ALLOWED})
    assert "access-control-allow-origin" not in r.headers


def test_wildcard_origin_and_credentials(server_factory):
    srv = server_factory(allowed_origins=["*"])
    r = httpx.get(srv.url + "/health", headers={"Origin": OTHER})
    assert r.headers["access-control-allow-origin"] == "*"
    srv = server_factory(allowed_origins=["*"], allow_credentials=True)
    r = preflight(srv, "/v1/chat/completions", OTHER)
    # with credentials a browser refuses "*": the origin must be named
    assert r.headers["access-control-allow-origin"] == OTHER
    assert r.headers["access-control-allow-credentials"] == "true"
    r = httpx.get(srv.url + "/health", headers={"Origin": OTHER, "Cookie": "a=b"})
    assert r.headers["access-control-allow-origin"] == OTHER
    assert r.headers["access-control-allow-credentials"] == "true"


def test_methods_and_headers_not_allowed_are_refused_at_preflight(server_factory):
    srv = server_factory(allowed_origins=[ALLOWED], allowed_methods=["GET"], allowed_headers=["authorization"])
    assert preflight(srv, "/v1/models", ALLOWED, method="GET", headers="authorization").status_code == 200
    # a preflight whose status is not 2xx fails (Fetch, "CORS-preflight fetch"): the browser
    # sends no actual request
    r = preflight(srv, "/v1/chat/completions", ALLOWED, method="POST", headers="authorization")
    assert r.status_code == 400 and "POST" not in r.headers.get("access-control-allow-methods", "")
    r = preflight(srv, "/v1/models", ALLOWED, method="GET", headers="authorization, x-custom")
    assert r.status_code == 400 and "x-custom" not in allowed_header_names(r)
