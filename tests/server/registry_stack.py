"""The registry side of a real in-process server, for the real-engine serving tests: a SQLite
registry under ``home``, a local blob store, the adapter disk cache and an ``AdapterManager`` for
the engine's base model, the server settings, and tenant ``acme`` with an API key."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from starlette.testclient import TestClient

from loraplex import LLM
from loraplex.config import Settings
from loraplex.engine.async_engine import AsyncLLMEngine
from loraplex.registry import db
from loraplex.registry.adapter_manager import AdapterManager
from loraplex.registry.service import RegistryService
from loraplex.server.app import create_app
from loraplex.storage.base import open_blob_store

TENANT = "acme"


class RegistryStack(NamedTuple):
    """What ``create_app`` takes beside the engine, and the tenant's key."""

    settings: Settings
    registry: RegistryService
    manager: AdapterManager
    tenant_key: str  # TENANT's API key


def registry_stack(home: Path, llm: LLM, model_dir: Path, admin_key: str, max_lora_rank: int = 8,
                   **settings_fields) -> RegistryStack:
    """The stack for ``llm`` (serving ``model_dir``); ``settings_fields``: more ``Settings`` fields."""
    url = f"sqlite:///{home / 'registry.db'}"
    db.upgrade(url)
    registry = RegistryService.from_url(url)
    manager = AdapterManager(registry, open_blob_store(str(home / "blobs")),
                             AdapterManager.make_disk_cache(home / "adapter-cache", 1 << 30),
                             llm.engine.runner.lora_target_spec(), max_lora_rank)
    settings = Settings(home=home, admin_key=admin_key, database_url=url, blob_gc_interval_seconds=0,
                        model=str(model_dir), **settings_fields)
    registry.create_tenant(TENANT)
    _, key = registry.create_api_key(TENANT)
    return RegistryStack(settings, registry, manager, key)


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@contextmanager
def real_server(model_dir: Path, home: Path, admin_key: str, llm_options: dict,
                **settings_fields) -> Iterator[tuple[TestClient, RegistryStack]]:
    """The app on a real float32 engine for ``model_dir`` (``LLM(**llm_options)``) and this
    module's stack, started; the client sends the admin key."""
    llm = LLM(model=str(model_dir), dtype="float32", home=home, **llm_options)
    engine = AsyncLLMEngine(llm.config, engine=llm.engine)
    stack = registry_stack(home, llm, model_dir, admin_key, max_lora_rank=llm_options.get("max_lora_rank", 8),
                           **settings_fields)
    with TestClient(create_app(stack.settings, engine=engine, registry=stack.registry, adapters=stack.manager)) as client:
        client.headers["Authorization"] = f"Bearer {admin_key}"
        yield client, stack


def upload(client: TestClient, name: str, path: Path) -> dict:
    """Upload the PEFT directory ``path`` as a new version of TENANT's ``name`` (201 asserted)."""
    r = client.post(f"/admin/v1/tenants/{TENANT}/adapters/{name}/versions",
                    files={n: (n, (path / n).read_bytes()) for n in ADAPTER_FILES})
    assert r.status_code == 201, r.text
    return r.json()


def stream_around(client: TestClient, headers: dict, body: dict, action: Callable[[], object]) -> tuple[str, object]:
    """Stream a completion, call ``action()`` once its first chunk arrived, read the rest:
    ``(the whole text, what action returned)``."""
    text, done = "", None
    with client.stream("POST", "/v1/completions", headers=headers, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
                if done is None:
                    done = (action(),)
    return text, done[0]
