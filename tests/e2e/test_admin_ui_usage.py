"""The admin UI's Usage view in headless Chromium against a real ``loraplex serve``: after real
requests, the tenant's rows and totals show what the answers' ``usage`` reported, by adapter
(the base model here) and UTC day or hour."""

from __future__ import annotations

from datetime import datetime, timezone

import httpx
import pytest

from tests.e2e.admin_ui_harness import (  # noqa: F401  (fixtures)
    browser,
    screenshot,
    sign_in,
    ui,
    ui_model_dir,
    ui_server,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def test_usage_view_shows_what_the_answers_reported(ui, ui_server):
    with ui_server.admin() as admin:
        assert admin.post("/admin/v1/tenants", json={"name": "billed"}).status_code == 201
        key = admin.post("/admin/v1/tenants/billed/keys").json()["key"]
    first_day = datetime.now(timezone.utc).date().isoformat()
    prompt = completion = 0
    for text in ("one", "two words"):
        r = httpx.post(ui_server.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                       json={"model": "base-model", "prompt": text, "max_tokens": 3})
        assert r.status_code == 200, r.text
        prompt += r.json()["usage"]["prompt_tokens"]
        completion += r.json()["usage"]["completion_tokens"]

    page = ui.page
    sign_in(page)
    page.select_option("#tenant-select", "billed")
    page.click("#nav-usage")
    row = page.locator("#usage-rows tr[data-adapter='']")
    row.wait_for()
    cells = row.locator("td").all_inner_texts()
    assert cells[0] in (first_day, datetime.now(timezone.utc).date().isoformat())  # midnight may pass
    assert cells[1:] == ["base model", "2", str(prompt), str(completion), str(prompt + completion), "0"]
    totals = page.locator("#usage-totals td").all_inner_texts()
    assert totals == ["2", str(prompt), str(completion), str(prompt + completion), "0"]

    page.select_option("#usage-period", "24h")  # by hour
    page.wait_for_selector("#usage-when:has-text('Hour')")
    hour_row = page.locator("#usage-rows tr[data-adapter='']")
    assert hour_row.get_attribute("data-when").endswith(":00:00Z")
    assert page.locator("#usage-totals td").all_inner_texts()[0] == "2"
    screenshot(page, "usage")
    assert ui.console_errors == []
