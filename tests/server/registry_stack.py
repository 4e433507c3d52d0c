"""The registry side of a real in-process server, for the real-engine serving tests: a SQLite
registry under ``home``, a local blob store, the adapter disk cache and an ``AdapterManager`` for
the engine's base model, the server settings, and tenant ``acme`` with an API key."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from loraplex import LLM
from loraplex.config import Settings
from loraplex.registry import db
from loraplex.registry.adapter_manager import AdapterManager
from loraplex.registry.service import RegistryService
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
