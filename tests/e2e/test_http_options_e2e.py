"""End to end: ``loraplex serve`` started with vLLM's HTTP flags (TLS with a CA made here, a
root path, CORS for one origin, a response role, no access lines), called over HTTPS as a
browser behind a path-stripping proxy would be: the handshake verifies against the CA, CORS
headers follow the Fetch standard's rules, the root path prefixes the URLs the server makes."""

from __future__ import annotations

import json
import ssl

import httpx
import pytest

from tests.e2e.server_process import start_server
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.fixtures.tls_certs import make_tls_files

pytestmark = pytest.mark.slow

ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("http-options")
    tls = make_tls_files(root / "tls")
    verify = ssl.create_default_context(cafile=str(tls.ca_cert))
    srv = start_server(
        root / "home", make_tiny_model_dir(root / "model", "llama", seed=3),
        "--ssl-certfile", str(tls.server_cert), "--ssl-keyfile", str(tls.server_key),
        "--root-path", "/llm", "--allowed-origins", json.dumps([ORIGIN]), "--response-role", "bot",
        "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", "--disable-fastapi-docs",
        "--max-model-len", "256", "--kv-cache-bytes", str(4 << 20), verify=verify,
    )
    with srv.admin() as admin:
        assert admin.post("/admin/v1/tenants", json={"name": "web"}).status_code in (200, 201)
        key = admin.post("/admin/v1/tenants/web/keys", json={}).json()["key"]
    yield srv, key, tls
    srv.stop()


def test_https_chat_from_a_browser_origin(served):
    srv, key, tls = served
    assert srv.url.startswith("https://")
    path = "/t/web/v1/chat/completions"
    pre = httpx.options(srv.url + path, verify=srv.verify, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    with srv.client(key) as c:
        body = {"model": "base-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        r = c.post(path, json=body, headers={"Origin": ORIGIN})
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert r.json()["choices"][0]["message"]["role"] == "bot"
        denied = c.post(path, json=body, headers={"Origin": ORIGIN, "Authorization": "Bearer wrong"})
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN
        other = c.post(path, json=body, headers={"Origin": "https://other.example"})
        assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(srv.url + "/health", verify=ssl.create_default_context(cafile=str(tls.other_ca_cert)))


def test_root_path_and_quiet_access_log(served):
    srv, key, _ = served
    r = httpx.get(srv.url + "/admin", verify=srv.verify, follow_redirects=False)
    assert httpx.URL(r.headers["location"]).path == "/llm/admin/"
    with srv.client(key) as c:  # a request that would write an access line
        assert c.post("/t/web/v1/completions", json={"model": "base-model", "prompt": "a", "max_tokens": 1}).is_success
    lines = [ln for ln in srv.log().splitlines() if ln.startswith("{")]
    assert [ln for ln in lines if json.loads(ln).get("event") == "request"] == []
