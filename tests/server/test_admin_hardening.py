"""Admin and tenant routes under hostile or mistaken input: every refusal is an OpenAI envelope
naming the right ``param``, and refusals, deletes and uploads leave no state behind."""

from __future__ import annotations

import httpx
import pytest

from tests.server.test_errors_fake import _envelope

DEEP = "[" * 100_000 + "]" * 100_000  # deeper than Python's recursion limit


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_deeply_nested_tenant_body_is_a_400(module_server, path):
    key = module_server.make_tenant(f"nest{len(path)}")
    with module_server.tenant_client(key) as t:
        r = t.post(path, content='{"model": ' + DEEP + "}", headers={"content-type": "application/json"})
    _envelope(r, 400)


def test_deeply_nested_admin_body_is_a_400(module_server):
    with module_server.admin() as c:
        r = c.post("/admin/v1/tenants", content='{"name": ' + DEEP + "}", headers={"content-type": "application/json"})
    _envelope(r, 400)
