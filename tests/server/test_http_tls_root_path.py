"""TLS (vLLM's --ssl-keyfile, --ssl-certfile, --ssl-ca-certs, --ssl-cert-reqs) and the root path
(--root-path) on a real uvicorn server configured as ``loraplex serve`` configures it, with a
fake engine; certificates from a throwaway CA made in the test.

TLS is checked as a client checks it: the handshake verifies against the CA that signed the
server's certificate, fails against another CA, and a server asking for client certificates
refuses a client without one. The root path as ASGI defines it: the proxy strips the prefix, the
app routes what is left and writes the prefix into the URLs it makes.
"""

from __future__ import annotations

import re
import ssl

import httpx
import pytest

from loraplex.server.app import DEFAULT_ADMIN_DIR
from tests.fixtures.tls_certs import make_tls_files

ADMIN = {"Authorization": "Bearer test-admin-key"}


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return make_tls_files(tmp_path_factory.mktemp("tls"))


def client_context(ca, cert=None, key=None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


def test_https_verifies_against_the_servers_ca_only(server_factory, tls):
    srv = server_factory(ssl_certfile=tls.server_cert, ssl_keyfile=tls.server_key)
    assert srv.url.startswith("https://")
    r = httpx.get(srv.url + "/v1/models", headers=ADMIN, verify=client_context(tls.ca_cert))
    assert r.status_code in (200, 401)  # served over TLS (the admin key is no tenant key)
    assert httpx.get(srv.url + "/health", verify=client_context(tls.ca_cert)).json() == {"status": "ok"}
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(srv.url + "/health", verify=client_context(tls.other_ca_cert))
    try:  # plain HTTP to the TLS port gets no HTTP answer
        r = httpx.get(srv.url.replace("https://", "http://") + "/health", timeout=5)
    except httpx.HTTPError:
        pass
    else:
        pytest.fail(f"plain HTTP answered {r.status_code}")


def test_required_client_certificates(server_factory, tls):
    srv = server_factory(ssl_certfile=tls.server_cert, ssl_keyfile=tls.server_key, ssl_ca_certs=tls.ca_cert,
                         ssl_cert_reqs=ssl.CERT_REQUIRED)
    ok = httpx.get(srv.url + "/health", verify=client_context(tls.ca_cert, tls.client_cert, tls.client_key))
    assert ok.status_code == 200
    with pytest.raises(httpx.HTTPError):  # TLS 1.3: the refusal may come at the first read
        httpx.get(srv.url + "/health", verify=client_context(tls.ca_cert), timeout=5).raise_for_status()


def test_root_path_routes_what_the_proxy_forwards_and_prefixes_the_urls_it_makes(server_factory):
    srv = server_factory(root_path="/llm")
    key = srv.make_tenant("acme")
    # the proxy got /llm/t/acme/v1/models and forwards /t/acme/v1/models
    r = httpx.get(srv.url + "/t/acme/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200 and r.json()["object"] == "list"
    assert httpx.get(srv.url + "/ready").status_code == 200
    # a redirect the app makes points at the proxy's path, prefix included
    r = httpx.get(srv.url + "/admin", follow_redirects=False)
    assert r.status_code in (301, 307, 308)
    assert httpx.URL(r.headers["location"]).path == "/llm/admin/"


def test_the_admin_ui_names_its_assets_and_api_relative_to_where_it_is_served(server_factory):
    # a browser at https://proxy/llm/admin/ resolves a URL starting with "/" outside /llm
    srv = server_factory(root_path="/llm")
    page = httpx.get(srv.url + "/admin/").text
    urls = re.findall(r'(?:href|src)="([^"]+)"', page)
    assert urls, "the page names its assets"
    assert [u for u in urls if u.startswith("/")] == []
    scripts = [p for p in DEFAULT_ADMIN_DIR.rglob("*.js")]
    for script in scripts:
        text = httpx.get(srv.url + "/admin/" + script.relative_to(DEFAULT_ADMIN_DIR).as_posix()).text
        # every import is relative, and no fetch names a root-absolute path
        assert not re.findall(r'\bfrom\s+"/', text), script
        assert not re.findall(r'(?:fetch|open)\(\s*"/', text), script
        assert not re.findall(r'=\s*"/admin', text), script
