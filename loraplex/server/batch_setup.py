"""The parts of a batch run, built as ``loraplex serve`` builds them (app.new_context /
use_parts) but without the HTTP app: the engine, the routes' context, and the adapters
(batch_adapters.py), with the registry only when ``--tenant`` names one of its tenants."""

from __future__ import annotations

from loraplex.config import Settings
from loraplex.server.context import AppContext


class SetupError(Exception):
    """Why the run cannot happen, with the exit status to give (2: flags or files, 1: the model)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def build_batch_context(settings: Settings, modules: list, tenant: str | None, engine=None) -> AppContext:
    """The context lines are answered in: ``engine`` (an ``AsyncLLMEngine``; built from
    ``settings`` when not given), ``modules`` (``LoraModule``s) checked against its base model,
    and the registry's adapters of ``tenant``. Raises ``SetupError``."""
    from loraplex.lora.errors import InvalidAdapterError
    from loraplex.server.app import new_context, use_parts
    from loraplex.server.batch_adapters import BatchAdapters
    from loraplex.server.tenant_limits import TenantLimitsCache

    # an operator's per-tenant cap and weight are for sharing a server: a batch run owns its
    # engine, and its lines must not meet a 429 (its concurrency is --max-concurrency)
    no_tenant_limits = TenantLimitsCache(lambda name: None)
    try:
        # bad parser or chat template settings: before the model loads
        ctx = new_context(settings, tenant_limits=no_tenant_limits)
    except ValueError as exc:
        raise SetupError(str(exc), 2) from None
    registry = _open_registry(settings, tenant) if tenant is not None else None
    if engine is None:
        engine = _load_engine(settings)
    try:
        try:
            use_parts(ctx, engine, registry, None)
        except ValueError as exc:  # a reasoning parser whose tags the model's tokenizer splits
            raise SetupError(str(exc), 2) from None
        spec = engine.engine.runner.lora_target_spec()
        fallback = None
        if registry is not None:
            from loraplex.registry.adapter_manager import build_adapter_manager

            fallback = build_adapter_manager(settings, registry, spec)
        try:
            ctx.adapters = BatchAdapters.load(modules, spec, settings.max_lora_rank, ctx.served_model_name, fallback)
        except (InvalidAdapterError, ValueError, OSError) as exc:
            raise SetupError(f"--lora-modules: {getattr(exc, 'message', None) or exc}", 2) from None
    except BaseException:
        close_batch_context(ctx)
        raise
    return ctx


def close_batch_context(ctx: AppContext) -> None:
    ctx.tokenizer_thread.shutdown(wait=False, cancel_futures=True)
    if ctx.engine is not None:
        ctx.engine.shutdown()


def _open_registry(settings: Settings, tenant: str):
    from loraplex.registry import db
    from loraplex.registry.service import RegistryService

    url = settings.resolved_database_url()
    try:
        db.upgrade(url)
        registry = RegistryService.from_url(url)
        found = registry.get_tenant(tenant)
    except Exception as exc:  # an unreachable database, a URL no driver takes
        raise SetupError(f"cannot open the registry: {exc}", 1) from None
    if found is None:
        raise SetupError(f"--tenant: no tenant {tenant!r} in the registry (create it with "
                         f"`loraplex tenants create {tenant}`)", 2)
    return registry


def _load_engine(settings: Settings):
    from loraplex.engine.async_engine import AsyncLLMEngine

    try:
        return AsyncLLMEngine(settings.engine_config())
    except Exception as exc:  # a missing model, a model loraplex cannot run, no memory for it
        raise SetupError(f"cannot load the model {settings.model!r}: {exc}", 1) from None
