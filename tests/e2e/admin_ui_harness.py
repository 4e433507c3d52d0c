"""Harness for the admin web UI tests: the real server, adapters, Chromium, and page helpers.

One ``loraplex serve`` process per module (``tests/e2e/server_process.py``: uvicorn on a free
loopback port, tiny random-weight Llama, SQLite and blobs in a temp LORAPLEX_HOME); PEFT adapters
made by peft for that model. Playwright drives Debian's Chromium (``/usr/bin/chromium``;
Playwright's own browser download is never used). What the UI shows is checked against the HTTP
API and the adapters' own PEFT configs, not against strings copied from the UI.

Screenshots of the main views go to ``tests/artifacts/screenshots/`` (gitignored).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.server_process import ADMIN_KEY, ServerProcess, start_server
from tests.fixtures.peft_adapters import make_peft_adapter
from tests.fixtures.tiny_models import make_tiny_model_dir

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / "tests" / "artifacts" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WAIT_MS = 20_000  # for anything that crosses the server (uploads validate and store a blob)


def _require_chromium() -> None:
    if Path(CHROMIUM).exists():
        return
    message = f"{CHROMIUM} is missing (Debian package `chromium`; scripts/test.sh installs it)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def ui_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("ui-model") / "tiny-llama", "llama")


@pytest.fixture(scope="module")
def ui_server(tmp_path_factory, ui_model_dir) -> ServerProcess:
    """``loraplex serve`` as its own process, as an operator would start it."""
    server = start_server(
        tmp_path_factory.mktemp("ui-home"), ui_model_dir,
        "--kv-cache-bytes", str(4 << 20), "--max-loras", "2", "--max-lora-rank", "16",
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def ui_adapters(tmp_path_factory, ui_model_dir) -> dict[str, Path]:
    """PEFT adapter directories for the served tiny model, made by peft itself."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(ui_model_dir), dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("ui-adapters")
    v1 = make_peft_adapter(base, root / "v1", seed=1, r=4, target_modules=["q_proj", "v_proj"])
    v2 = make_peft_adapter(base, root / "v2", seed=2, r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    dora = root / "dora"
    shutil.copytree(v1, dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    config["use_dora"] = True
    (dora / "adapter_config.json").write_text(json.dumps(config))
    return {"v1": v1, "v2": v2, "dora": dora}


def adapter_files(adapter_dir: Path) -> list[str]:
    return [str(adapter_dir / "adapter_config.json"), str(adapter_dir / "adapter_model.safetensors")]


def peft_config(adapter_dir: Path) -> dict:
    return json.loads((adapter_dir / "adapter_config.json").read_text())


@pytest.fixture(scope="module")
def browser():
    _require_chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@dataclass
class UIPage:
    page: object
    console_errors: list[str]
    request_urls: list[str]
    cookies: object  # () -> list of the context's cookies


@pytest.fixture
def ui(browser, ui_server) -> UIPage:
    context = browser.new_context(viewport={"width": 1280, "height": 860}, base_url=ui_server.url)
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=ui_server.url)
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    errors: list[str] = []
    urls: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("request", lambda req: urls.append(req.url))
    yield UIPage(page=page, console_errors=errors, request_urls=urls, cookies=context.cookies)
    context.close()


def screenshot(page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.evaluate("() => document.querySelector('#toasts').replaceChildren()")  # transient notes
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def sign_in(page) -> None:
    page.goto("/admin/")
    page.fill("#signin-key", ADMIN_KEY)
    page.click("#signin-submit")
    page.wait_for_selector("#console:not([hidden])")


def create_tenant(page, name: str) -> None:
    page.click("#nav-tenants")
    page.fill("#tenant-name", name)
    page.click("#tenant-create")
    page.wait_for_selector(f"#tenant-rows tr[data-tenant='{name}']")
    assert page.input_value("#tenant-select") == name


def upload(page, name: str, files: list[str]) -> None:
    page.click("#nav-adapters")
    page.fill("#upload-name", name)
    page.set_input_files("#upload-files", files)
    page.click("#upload-submit")
    page.wait_for_function("() => ['done', 'error'].includes(document.querySelector('#upload-card').dataset.uploadState)")

