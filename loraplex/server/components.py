"""Building the server's parts from Settings: registry (migrated), engine, adapter manager.

``prepare_registry`` is quick (migrations, admin key, demo tenant) and runs before the server
listens, so its one-time secrets are printed first; ``build_components`` loads the model and runs
at app startup, off the event loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from loraplex.config import Settings

log = logging.getLogger("loraplex.server")
DEMO_TENANT = "demo"


@dataclass
class Components:
    engine: object
    registry: object
    adapters: object


@dataclass
class RegistrySetup:
    registry: object
    admin_secret: str | None = None  # generated now: print it once
    demo_key: str | None = None  # demo tenant created now: print it once
    notes: list[str] = field(default_factory=list)


def prepare_registry(settings: Settings, *, create_demo: bool) -> RegistrySetup:
    """Migrate the database and open the registry. Without ``settings.admin_key`` an admin key is
    generated and stored hashed (once per database). With ``create_demo`` a ``demo`` tenant and a
    key are made when the tenant does not exist yet (a deleted ``demo`` stays deleted: a note says so)."""
    from loraplex.registry import db
    from loraplex.registry.service import RegistryService

    settings.home.mkdir(parents=True, exist_ok=True)
    url = settings.resolved_database_url()
    db.upgrade(url)
    registry = RegistryService.from_url(url)
    setup = RegistrySetup(registry)
    if not settings.admin_key:
        setup.admin_secret = registry.get_or_create_admin_key()
        if setup.admin_secret is None:
            setup.notes.append("admin key: the one generated at first start (set LORAPLEX_ADMIN_KEY to use your own)")
    if create_demo and registry.get_tenant(DEMO_TENANT) is None:
        from loraplex.registry.errors import TenantDeleted

        try:
            registry.create_tenant(DEMO_TENANT, actor="system")
        except TenantDeleted:  # an operator deleted it: deleted tenants stay deleted
            setup.notes.append(f"tenant {DEMO_TENANT!r} was deleted; not recreated (tenant names are never reused)")
            return setup
        _, setup.demo_key = registry.create_api_key(DEMO_TENANT, actor="system")
    return setup


def build_components(settings: Settings, *, engine=None, registry=None, adapters=None) -> Components:
    """The parts not given: the registry, the engine (loads the model), the adapter manager."""
    if registry is None:
        registry = prepare_registry(settings, create_demo=False).registry
    built_engine = engine is None
    if engine is None:
        from loraplex.engine.async_engine import AsyncLLMEngine

        engine = AsyncLLMEngine(settings.engine_config())
        engine.warm_grammars()
    try:
        if adapters is None:
            from loraplex.registry.adapter_manager import build_adapter_manager

            spec = engine.engine.runner.lora_target_spec()
            # requests release adapters on the event loop: deferred blob deletes go to a thread
            adapters = build_adapter_manager(settings, registry, spec, background_deletes=True)
    except BaseException:
        if built_engine:  # the caller never gets this engine to stop: its thread would run on
            _shutdown_quietly(engine)
        raise
    return Components(engine=engine, registry=registry, adapters=adapters)


def _shutdown_quietly(engine) -> None:
    """Stop an engine whose build failed after it; an error here is logged, so the build's own
    error is the one raised."""
    try:
        engine.shutdown()
    except Exception:  # noqa: BLE001
        log.exception("stopping the engine after the failed start failed too")
