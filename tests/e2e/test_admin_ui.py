"""The admin web UI in a real headless Chromium against the real server: sign-in, tenants and
keys, upload through the file input (and an archive dropped on the drop zone), hot-swap with
its confirmation, the audit log, refused uploads, load / pin / unload, the live status panel.

Fixtures and helpers: ``tests/e2e/admin_ui_harness.py``. Screenshots of the main views go to
``tests/artifacts/screenshots/`` (gitignored).
"""

from __future__ import annotations

import base64
import io
import tarfile
from pathlib import Path

import httpx
import pytest

from tests.e2e.admin_ui_harness import (  # noqa: F401  (fixtures)
    ADMIN_KEY,
    create_tenant,
    adapter_files,
    peft_config,
    screenshot,
    sign_in,
    upload,
    browser,
    ui,
    ui_adapters,
    ui_model_dir,
    ui_server,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def test_sign_in_keeps_the_admin_key_out_of_urls_and_cookies(ui, ui_server):
    page = ui.page
    page.goto("/admin/")
    page.fill("#signin-key", "not-the-admin-key")
    page.click("#signin-submit")
    page.wait_for_selector("#signin-error:has-text('refused')")
    assert page.is_hidden("#console")
    assert page.evaluate("sessionStorage.length") == 0

    # the request the UI made with the wrong key was answered 401 by the real server
    assert httpx.get(ui_server.url + "/admin/v1/tenants", headers={"Authorization": "Bearer not-the-admin-key"}).status_code == 401

    sign_in(page)
    stored = page.evaluate("Object.values(sessionStorage)")
    assert ADMIN_KEY in stored
    assert page.evaluate("document.cookie") == ""
    assert ui.cookies() == []
    assert ui.request_urls, "the UI made no requests"
    assert not [u for u in ui.request_urls if ADMIN_KEY in u]
    assert ADMIN_KEY not in page.url

    # a reload in the same tab stays signed in (sessionStorage), signing out forgets the key
    page.reload()
    page.wait_for_selector("#console:not([hidden])")
    page.click("#signout")
    page.wait_for_selector("#signin:not([hidden])")
    assert page.evaluate("sessionStorage.getItem('loraplex.adminKey')") is None
    assert ui.console_errors == []


def test_tenant_key_upload_hot_swap_and_audit(ui, ui_server, ui_adapters):
    page = ui.page
    tenant, adapter = "acme", "support"
    sign_in(page)
    create_tenant(page, tenant)
    with ui_server.admin() as admin:
        assert tenant in [t["name"] for t in admin.get("/admin/v1/tenants").json()["data"]]

    # the tenant's serving limits: the defaults, then what an operator set through the admin API
    tenant_cells = page.locator(f"#tenant-rows tr[data-tenant='{tenant}'] td")
    assert tenant_cells.all_inner_texts()[2:6] == ["server default", "1", "unlimited", "unlimited"]
    with ui_server.admin() as admin:
        r = admin.patch(f"/admin/v1/tenants/{tenant}", json={"max_concurrent_requests": 3, "scheduling_weight": 2.5,
                                                              "max_tokens_per_minute": 40000})
        assert r.status_code == 200
    page.reload()
    page.wait_for_selector(f"#tenant-rows tr[data-tenant='{tenant}'] td:has-text('2.5')")
    assert tenant_cells.all_inner_texts()[2:6] == ["3", "2.5", "unlimited", "40000"]

    # a key: the secret is shown once, the copy button puts it on the clipboard, and it works
    page.click("#key-create")
    page.wait_for_selector("#key-secret:not([hidden])")
    secret = page.input_value("#key-secret-value")
    assert secret
    page.click("#key-secret-copy")
    assert page.evaluate("navigator.clipboard.readText()") == secret
    models = httpx.get(f"{ui_server.url}/t/{tenant}/v1/models", headers={"Authorization": f"Bearer {secret}"})
    assert models.status_code == 200
    screenshot(page, "tenants")
    page.click("#key-secret-dismiss")
    assert page.input_value("#key-secret-value") == ""
    key_rows = page.locator("#key-rows tr[data-key-id]")
    assert key_rows.count() == 1

    # upload v1 through the file input: it shows up in the table with its PEFT config's numbers
    upload(page, adapter, adapter_files(ui_adapters["v1"]))
    assert "Uploaded" in page.inner_text("#upload-message"), page.inner_text("#upload-message")
    assert page.get_attribute("#upload-progress", "value") == "100"
    row = page.locator(f"tr.adapter-row[data-adapter='{adapter}']")
    row.wait_for()
    config_v1 = peft_config(ui_adapters["v1"])
    cells = row.locator("td").all_inner_texts()
    assert cells[1] == "1" and cells[2] == "1"  # active version, number of versions
    assert cells[3] == str(config_v1["r"])
    assert set(cells[4].split(", ")) == set(config_v1["target_modules"])
    with ui_server.admin() as admin:
        listed = admin.get(f"/admin/v1/tenants/{tenant}/adapters/{adapter}").json()
    assert listed["active_version"] == 1
    assert cells[6].split()[0] == listed["tier"]

    # the tenant now sees its adapter through the OpenAI API
    models = httpx.get(f"{ui_server.url}/t/{tenant}/v1/models", headers={"Authorization": f"Bearer {secret}"}).json()
    assert adapter in [m["id"] for m in models["data"]]

    # v2, then hot-swap to it: cancelling the confirmation changes nothing, confirming swaps
    upload(page, adapter, adapter_files(ui_adapters["v2"]))
    assert "v2" in page.inner_text("#upload-message"), page.inner_text("#upload-message")
    page.wait_for_selector(f"tr.adapter-row[data-adapter='{adapter}'] .col-versions:has-text('2')")
    row.locator("button").first.click()
    detail = page.locator(f"tr.adapter-detail[data-adapter='{adapter}']")
    detail.locator("tr.version-row[data-version='2'] button:has-text('Activate')").click()
    page.wait_for_selector("#confirm-dialog[open]")
    assert "v2" in page.inner_text("#confirm-title")
    screenshot(page, "hot-swap-confirm")
    page.click("#confirm-cancel")
    page.wait_for_selector("#confirm-dialog", state="hidden")
    with ui_server.admin() as admin:
        assert admin.get(f"/admin/v1/tenants/{tenant}/adapters/{adapter}").json()["active_version"] == 1

    detail.locator("tr.version-row[data-version='2'] button:has-text('Activate')").click()
    page.click("#confirm-ok")
    page.wait_for_selector(f"tr.adapter-row[data-adapter='{adapter}'] .col-active:text-is('2')")
    with ui_server.admin() as admin:
        assert admin.get(f"/admin/v1/tenants/{tenant}/adapters/{adapter}").json()["active_version"] == 2
    config_v2 = peft_config(ui_adapters["v2"])
    cells = row.locator("td").all_inner_texts()
    assert cells[3] == str(config_v2["r"])
    assert set(cells[4].split(", ")) == set(config_v2["target_modules"])

    # a request by name after the swap is served by v2: its version row counts it, v1's does not
    reply = httpx.post(
        f"{ui_server.url}/t/{tenant}/v1/completions",
        headers={"Authorization": f"Bearer {secret}"},
        json={"model": adapter, "prompt": "hello", "max_tokens": 4},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    page.click("#nav-adapters")  # the view reloads its table when shown
    versions = page.locator(f"tr.adapter-detail[data-adapter='{adapter}'] tr.version-row")
    page.wait_for_selector(f"tr.adapter-detail[data-adapter='{adapter}'] tr.version-row[data-version='2'] .col-requests:text-is('1')")
    assert versions.locator(".col-requests").all_inner_texts() == ["0", "1"]
    screenshot(page, "adapters")

    # the audit log shows the swap, who made it and from which version to which
    page.click("#nav-audit")
    swap = page.locator("#audit-rows tr[data-action='adapter.activate']").filter(has_text="to=2")
    swap.first.wait_for()
    text = swap.first.inner_text()
    assert "admin" in text and adapter in text and "from=1" in text
    with ui_server.admin() as admin:
        events = admin.get("/admin/v1/audit", params={"tenant": tenant}).json()["data"]
    assert page.locator("#audit-rows tr[data-action]").count() == len(events)
    screenshot(page, "audit")

    # revoking the key in the UI makes the tenant API refuse it
    page.click("#nav-tenants")
    page.locator("#key-rows button:has-text('Revoke')").click()
    page.click("#confirm-ok")
    page.wait_for_selector("#key-rows tr[data-key-id] td:has-text('revoked')")
    refused = httpx.get(f"{ui_server.url}/t/{tenant}/v1/models", headers={"Authorization": f"Bearer {secret}"})
    assert refused.status_code == 401
    assert ui.console_errors == []


def test_refused_upload_shows_the_servers_message(ui, ui_server, ui_adapters):
    page = ui.page
    tenant = "refusals"
    sign_in(page)
    create_tenant(page, tenant)

    # what the server says about this upload, asked directly over HTTP
    with ui_server.admin() as admin:
        files = {name: (name, (ui_adapters["dora"] / name).read_bytes()) for name in ("adapter_config.json", "adapter_model.safetensors")}
        answer = admin.post(f"/admin/v1/tenants/{tenant}/adapters/probe/versions", files=files)
    assert answer.status_code == 400, answer.text
    server_message = answer.json()["error"]["message"]
    assert "dora" in server_message.lower()

    upload(page, "dora-adapter", adapter_files(ui_adapters["dora"]))
    message = page.locator("#upload-message")
    assert message.get_attribute("class") == "message error"
    assert server_message in message.inner_text()
    assert page.is_hidden("#upload-progress")

    # a pickle weights file is refused too, with the server's own words
    pickle_file = ui_adapters["dora"].parent / "adapter_model.bin"
    pickle_file.write_bytes(b"\x80\x04not really a pickle")
    with ui_server.admin() as admin:
        files = {"adapter_config.json": ("adapter_config.json", (ui_adapters["v1"] / "adapter_config.json").read_bytes()),
                 "adapter_model.bin": ("adapter_model.bin", pickle_file.read_bytes())}
        answer = admin.post(f"/admin/v1/tenants/{tenant}/adapters/probe/versions", files=files)
    assert answer.status_code == 400, answer.text
    upload(page, "pickled", [str(ui_adapters["v1"] / "adapter_config.json"), str(pickle_file)])
    assert answer.json()["error"]["message"] in page.inner_text("#upload-message")
    screenshot(page, "upload-refused")

    with ui_server.admin() as admin:
        assert admin.get(f"/admin/v1/tenants/{tenant}/adapters").json()["data"] == []
    page.wait_for_selector("#adapter-rows td.empty")
    assert ui.console_errors == []


def _archive(adapter_dir: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            tar.add(adapter_dir / name, arcname=f"{adapter_dir.name}/{name}")
    return buf.getvalue()


def test_archive_dropped_on_the_drop_zone_is_uploaded_then_deleted(ui, ui_server, ui_adapters):
    page = ui.page
    tenant, adapter = "dropper", "dropped"
    sign_in(page)
    create_tenant(page, tenant)
    page.click("#nav-adapters")
    page.fill("#upload-name", adapter)
    payload = base64.b64encode(_archive(ui_adapters["v1"])).decode()
    # a drop event carrying one .tar.gz, as a file manager would deliver it
    page.evaluate(
        """(b64) => {
            const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
            const transfer = new DataTransfer();
            transfer.items.add(new File([bytes], "adapter.tar.gz", {type: "application/gzip"}));
            const zone = document.querySelector("#drop-zone");
            zone.dispatchEvent(new DragEvent("dragover", {dataTransfer: transfer, bubbles: true, cancelable: true}));
            zone.dispatchEvent(new DragEvent("drop", {dataTransfer: transfer, bubbles: true, cancelable: true}));
        }""",
        payload,
    )
    page.wait_for_selector("#upload-file-list li:has-text('adapter.tar.gz')")
    page.click("#upload-submit")
    page.wait_for_function("() => ['done', 'error'].includes(document.querySelector('#upload-card').dataset.uploadState)")
    assert "Uploaded" in page.inner_text("#upload-message"), page.inner_text("#upload-message")
    page.wait_for_selector(f"tr.adapter-row[data-adapter='{adapter}']")
    with ui_server.admin() as admin:
        listed = admin.get(f"/admin/v1/tenants/{tenant}/adapters/{adapter}").json()
    assert listed["active_version"] == 1
    assert listed["versions"][0]["rank"] == peft_config(ui_adapters["v1"])["r"]

    # and deleted again, after the confirmation
    page.locator(f"tr.adapter-row[data-adapter='{adapter}'] button").first.click()
    page.locator(f"tr.adapter-detail[data-adapter='{adapter}'] button:has-text('Delete adapter')").click()
    page.click("#confirm-ok")
    page.wait_for_selector(f"tr.adapter-row[data-adapter='{adapter}']", state="detached")
    with ui_server.admin() as admin:
        assert admin.get(f"/admin/v1/tenants/{tenant}/adapters/{adapter}").status_code == 404
    assert ui.console_errors == []


def test_load_pin_unload_move_the_adapter_between_tiers(ui, ui_server, ui_adapters):
    page = ui.page
    tenant, adapter = "tiers", "warm"
    sign_in(page)
    create_tenant(page, tenant)
    upload(page, adapter, adapter_files(ui_adapters["v1"]))
    row = page.locator(f"tr.adapter-row[data-adapter='{adapter}']")
    row.locator("button").first.click()
    detail = page.locator(f"tr.adapter-detail[data-adapter='{adapter}']")

    def server_tier() -> str:
        with ui_server.admin() as admin:
            return admin.get(f"/admin/v1/tenants/{tenant}/adapters/{adapter}").json()["tier"]

    detail.locator("button:has-text('Pin on device')").click()
    page.wait_for_selector(f"tr.adapter-row[data-adapter='{adapter}'] .col-tier:has-text('device · pinned')")
    assert server_tier() == "device"
    with ui_server.admin() as admin:
        assert admin.get(f"/admin/v1/tenants/{tenant}/adapters/{adapter}").json()["pinned"] is True
    with ui_server.admin() as admin:
        audit = admin.get("/admin/v1/audit", params={"tenant": tenant}).json()["data"]
    assert any(e["action"] == "adapter.load" and e["detail"].get("pin") is True for e in audit)

    detail.locator("button:has-text('Unload')").click()
    page.wait_for_function(
        "(name) => !document.querySelector(`tr.adapter-row[data-adapter='${name}'] .col-tier`).textContent.includes('device')",
        arg=adapter,
    )
    assert server_tier() not in ("device", "host")
    assert "pinned" not in page.inner_text(f"tr.adapter-row[data-adapter='{adapter}'] .col-tier")
    page.locator(f"tr.adapter-detail[data-adapter='{adapter}'] button:has-text('Load to host')").click()
    page.wait_for_selector(f"tr.adapter-row[data-adapter='{adapter}'] .col-tier:has-text('host')")
    assert server_tier() == "host"

    # a request through the tenant API: the table's requests and tokens are the server's counters
    with ui_server.admin() as admin:
        secret = admin.post(f"/admin/v1/tenants/{tenant}/keys", json={}).json()["key"]
    reply = httpx.post(
        f"{ui_server.url}/t/{tenant}/v1/completions",
        headers={"Authorization": f"Bearer {secret}"},
        json={"model": adapter, "prompt": "hi there", "max_tokens": 8, "ignore_eos": True},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    with ui_server.admin() as admin:
        listed = admin.get(f"/admin/v1/tenants/{tenant}/adapters/{adapter}").json()
    assert listed["requests"] == 1 and listed["tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    page.click("#nav-adapters")  # the view reloads its table when shown
    page.wait_for_selector(f"tr.adapter-row[data-adapter='{adapter}'] .col-requests:text-is('1')")
    assert page.inner_text(f"tr.adapter-row[data-adapter='{adapter}'] .col-tokens") == str(listed["tokens"])
    assert page.inner_text(f"tr.adapter-detail[data-adapter='{adapter}'] tr.version-row[data-version='1'] .col-tier").startswith(
        listed["versions"][0]["tier"]
    )
    screenshot(page, "adapters-in-use")
    assert ui.console_errors == []


def test_status_panel_follows_the_engine(ui, ui_server, ui_adapters):
    page = ui.page
    sign_in(page)
    page.click("#nav-overview")
    page.wait_for_function("() => Number(document.querySelector('#view-overview').dataset.updates || 0) >= 1")

    # requests through the tenant API: the panel's tokens/s comes off zero and the chart grows
    with ui_server.admin() as admin:
        admin.post("/admin/v1/tenants", json={"name": "status"})
        secret = admin.post("/admin/v1/tenants/status/keys", json={}).json()["key"]
        status = admin.get("/admin/v1/status").json()
    model = status["model"]
    before = int(page.get_attribute("#view-overview", "data-updates"))
    reply = httpx.post(
        f"{ui_server.url}/t/status/v1/completions",
        headers={"Authorization": f"Bearer {secret}"},
        json={"model": model, "prompt": "hello", "max_tokens": 24, "ignore_eos": True, "temperature": 0},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    # the chart's peak over its window, not the card: the card shows only the latest interval
    page.wait_for_function("() => Number(document.querySelector('#status-chart svg').dataset.peakTps) > 0")
    assert int(page.get_attribute("#status-chart svg", "data-samples")) >= 2
    page.wait_for_function("() => parseFloat(document.querySelector('[data-stat=ttft]').textContent) > 0")

    # the numbers shown are the server's: tier counts and running requests agree with GET /status
    with ui_server.admin() as admin:
        status = admin.get("/admin/v1/status").json()
    assert status["ttft_count"] >= 1 and status["generation_tokens_total"] >= 24
    page.wait_for_function("(n) => Number(document.querySelector('#view-overview').dataset.updates) >= n", arg=before + 4)
    for tier, count in status["adapters_per_tier"].items():
        assert float(page.inner_text(f"#tier-counts [data-tier='{tier}'] strong")) == count, tier
    assert float(page.inner_text("[data-stat=running]")) == status["num_requests_running"]
    screenshot(page, "overview")
    assert ui.console_errors == []


def test_progress_bar_follows_a_slow_upload(ui, ui_server, ui_adapters):
    page = ui.page
    tenant, adapter = "slow", "throttled"
    sign_in(page)
    create_tenant(page, tenant)
    # Chromium's own network throttling: the ~30 KB upload takes a second or two
    cdp = page.context.new_cdp_session(page)
    cdp.send("Network.enable")
    cdp.send("Network.emulateNetworkConditions", {"offline": False, "latency": 0, "downloadThroughput": -1, "uploadThroughput": 16_000})
    page.click("#nav-adapters")
    page.fill("#upload-name", adapter)
    page.set_input_files("#upload-files", adapter_files(ui_adapters["v2"]))
    page.click("#upload-submit")
    page.wait_for_function("() => { const v = document.querySelector('#upload-progress').value; return v > 0 && v < 100; }")
    assert page.is_visible("#upload-progress")
    assert " of " in page.inner_text("#upload-progress-label")
    page.wait_for_function("() => document.querySelector('#upload-card').dataset.uploadState === 'done'")
    assert page.get_attribute("#upload-progress", "value") == "100"
    with ui_server.admin() as admin:
        listed = admin.get(f"/admin/v1/tenants/{tenant}/adapters/{adapter}").json()
    assert listed["versions"][0]["rank"] == peft_config(ui_adapters["v2"])["r"]
    assert ui.console_errors == []
