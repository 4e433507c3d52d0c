"""The admin UI's tenant delete in headless Chromium against a real ``loraplex serve``: cancelling
the confirmation changes nothing; confirming deletes the tenant (its key gets 401, the admin API
no longer lists it), the other tenants stay and one of them becomes the selected one."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.admin_ui_harness import (  # noqa: F401  (fixtures)
    browser,
    create_tenant,
    screenshot,
    sign_in,
    ui,
    ui_model_dir,
    ui_server,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def _tenants(server) -> list[str]:
    with server.admin() as admin:
        return [t["name"] for t in admin.get("/admin/v1/tenants").json()["data"]]


def test_delete_tenant_after_confirmation(ui, ui_server):
    page = ui.page
    sign_in(page)
    create_tenant(page, "keeper")
    create_tenant(page, "leaver")  # now the selected tenant
    with ui_server.admin() as admin:
        key = admin.post("/admin/v1/tenants/leaver/keys").json()["key"]
    delete_button = page.locator("#tenant-rows tr[data-tenant='leaver'] button:has-text('Delete')")

    delete_button.click()
    page.wait_for_selector("#confirm-dialog[open]")
    assert "leaver" in page.inner_text("#confirm-title")
    assert "never" in page.inner_text("#confirm-body")
    screenshot(page, "tenant-delete-confirm")
    page.click("#confirm-cancel")
    page.wait_for_selector("#confirm-dialog", state="hidden")
    assert "leaver" in _tenants(ui_server)

    delete_button.click()
    page.wait_for_selector("#confirm-dialog[open]")
    page.click("#confirm-ok")
    page.wait_for_selector("#tenant-rows tr[data-tenant='leaver']", state="detached")
    left = _tenants(ui_server)  # the server's demo tenant (and other tests' tenants) stay too
    assert "leaver" not in left and "keeper" in left
    assert page.input_value("#tenant-select") in left  # another tenant is selected now
    r = httpx.get(ui_server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert r.status_code == 401
    assert ui.console_errors == []
