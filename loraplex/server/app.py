"""The app factory: ``create_app(settings, engine=..., registry=..., adapters=...)``.

Parts not passed in are built at startup from ``settings`` (``components.build_components``),
on a worker thread inside the lifespan's startup; uvicorn opens the port only once that is done
(as vLLM's server does), so ``/health`` and ``/ready`` first answer with the model loaded. Once started, a background thread collects unreferenced blobs every
``blob_gc_interval_seconds`` (``blob_gc.BlobGarbageCollector``; stopped at shutdown), and
another writes finished requests' usage to the registry every ``usage_flush_seconds``
(``usage_recorder.UsageRecorder``; flushed last at shutdown, what the database does not take
then spooled under ``home/usage-spool`` and replayed at the next start). Each part's stop is
recorded as it starts (``shutdown_steps.ShutdownSteps``): shutdown stops them last-started
first, and so does a start that fails part-way, before the process exits with its error.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
import logging
from pathlib import Path

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

import loraplex
from loraplex.config import Settings
from loraplex.registry.adapter_merges import AdapterMerger
from loraplex.server import (
    admin_routes,
    http_options,
    openai_routes,
    responses_routes,
    runtime_lora_routes,
    sglang_lora_routes,
    sglang_routes,
    tenant_delete_routes,
    tgi_info,
    tgi_routes,
    tokenizer_routes,
    usage_routes,
)
from loraplex.server.auth import AdminAuth, TenantAuth
from loraplex.server.blob_gc import BlobGarbageCollector
from loraplex.server.chat_template import load_chat_template
from loraplex.server.cluster_presence import ClusterPresence
from loraplex.template_content_format import ContentFormatResolver
from loraplex.server.components import Components
from loraplex.server.context import AppContext
from loraplex.server.errors import exception_handlers
from loraplex.server.lifecycle import Lifecycle, grace_ended_error
from loraplex.server.limits import BodySizeLimitMiddleware, TenantConcurrencyLimiter
from loraplex.server.metrics import CONTENT_TYPE, HttpMetricsMiddleware, ServerMetrics
from loraplex.server.reasoning_parsers import get_reasoning_parser
from loraplex.server.replica_deletes import watch_deletes
from loraplex.server.request_ids import RequestIdMiddleware
from loraplex.server.shutdown_steps import ShutdownSteps
from loraplex.server.tenant_limits import TenantLimitsCache
from loraplex.server.tool_parsers import get_tool_parser
from loraplex.server.uploads import sweep_stale_staging
from loraplex.server.usage_metrics import UsageCollector
from loraplex.server.usage_recorder import UsageRecorder
from loraplex.server.usage_spool import UsageSpool

log = logging.getLogger("loraplex.server")
USAGE_SPOOL_DIR = "usage-spool"  # under the home: usage the database did not take, replayed later
DEFAULT_ADMIN_DIR = Path(__file__).resolve().parents[2] / "admin"
# how long the shutdown waits for cancelled requests to close before the last usage flush
USAGE_SHUTDOWN_WAIT_SECONDS = 5.0


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def version(request: Request) -> Response:
    """vLLM's ``GET /version`` (deployment tooling reads it), with loraplex's version."""
    return JSONResponse({"version": loraplex.__version__})


async def ready(request: Request) -> Response:
    ctx: AppContext = request.app.state.ctx
    problems = []
    if not ctx.lifecycle.started:
        problems.append("model not loaded")
    elif getattr(ctx.engine, "is_running", True) is False:
        problems.append("engine stopped")
    if ctx.lifecycle.draining:
        problems.append("draining")
    if ctx.registry is not None and not ctx.lifecycle.draining:
        ping = getattr(ctx.registry, "ping", None)
        if ping is not None and not await run_in_threadpool(ping):
            problems.append("registry unreachable")
    if problems:
        return JSONResponse({"status": "not ready", "reasons": problems}, status_code=503)
    return JSONResponse({"status": "ready"})


async def metrics(request: Request) -> Response:
    ctx: AppContext = request.app.state.ctx
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)


def new_context(settings: Settings, *, engine=None, registry=None, adapters=None,
                tenant_limits: TenantLimitsCache | None = None) -> AppContext:
    """The routes' context on ``settings``, with whichever parts are given (the rest are set by
    ``use_parts`` once built). ``tenant_limits`` defaults to the registry's per-tenant settings. An unknown ``tool_call_parser`` or ``reasoning_parser``, or a
    ``chat_template`` that is neither a file nor a template that compiles, is a ValueError."""
    tool_parser = get_tool_parser(settings.tool_call_parser)
    chat_template = load_chat_template(settings.chat_template) if settings.chat_template else None
    reasoning_parser = get_reasoning_parser(settings.reasoning_parser)
    ctx = AppContext(
        settings=settings,
        engine=engine,
        registry=registry,
        adapters=adapters,
        served_model_name=settings.served_name,
        metrics=ServerMetrics(settings.served_name, settings.max_loras),
        limiter=TenantConcurrencyLimiter(settings.max_concurrent_requests_per_tenant),
        tenant_limits=tenant_limits or TenantLimitsCache(lambda name: ctx.registry.get_tenant(name),
                                                         settings.registry_poll_seconds),
        lifecycle=Lifecycle(),
        tenant_auth=TenantAuth(lambda secret: ctx.registry.authenticate(secret), settings.registry_poll_seconds),
        admin_auth=AdminAuth(settings.admin_key, lambda secret: ctx.registry.check_admin_key(secret)),
        staging_root=settings.staging_dir,
        tool_parser=tool_parser,
        reasoning_parser=reasoning_parser,
        chat_template=chat_template,
        content_format=ContentFormatResolver(settings.chat_template_content_format),
    )
    return ctx


def use_parts(ctx: AppContext, engine, registry, adapters) -> None:
    """Put the built parts in ``ctx``: a reasoning parser is checked against the engine's tokenizer
    (ValueError when its tags are not single tokens), the server's chat template goes onto the
    tokenizer, and without ``served_model_name`` the base model is served under the engine's
    name for it."""
    ctx.engine, ctx.registry, ctx.adapters = engine, registry, adapters
    if hasattr(adapters, "disk_cache") and hasattr(adapters, "local_path"):  # an AdapterManager
        ctx.merges = AdapterMerger(adapters)
    if ctx.reasoning_parser is not None:
        try:
            ctx.reasoning_parser.check_tokenizer(ctx.tokenizer)
        except ValueError as exc:
            log.error("%s", exc)  # the reason, on one line above uvicorn's traceback
            raise
    if ctx.chat_template is not None:  # every chat render and /tokenize reads it from here
        ctx.tokenizer.chat_template = ctx.chat_template
    if not ctx.settings.served_model_name and getattr(ctx.engine, "model_name", None):
        ctx.served_model_name = ctx.engine.model_name
        ctx.metrics.model_name = ctx.served_model_name
    if hasattr(adapters, "base_model_names"):  # no adapter may take the name requests reach the base by
        adapters.base_model_names = frozenset({ctx.served_model_name})


def _start_presence(ctx: AppContext) -> ClusterPresence:
    """Heartbeats into the registry for ``--tenant-limits-scope cluster`` (cluster_presence.py)."""
    beat, leave = getattr(ctx.registry, "replica_heartbeat", None), getattr(ctx.registry, "replica_leave", None)
    if beat is None or leave is None:
        raise ValueError("--tenant-limits-scope cluster needs the registry database to count replicas in")
    return ClusterPresence(beat, leave, ctx.settings.registry_poll_seconds).start()


async def _stop_usage(ctx: AppContext) -> None:
    """The recorder's last flush, once every admitted request has closed. uvicorn cancels the
    requests its graceful shutdown left running and runs the app's shutdown without waiting:
    their runs close (and count their usage) a few event-loop turns later."""
    if not await ctx.lifecycle.wait_idle(USAGE_SHUTDOWN_WAIT_SECONDS):
        log.error("usage accounting: %d request(s) still open at shutdown are not counted", ctx.lifecycle.in_flight)
    await run_in_threadpool(ctx.usage.stop)


def create_app(
    settings: Settings,
    *,
    engine=None,
    registry=None,
    adapters=None,
    admin_dir: Path | None = None,
    builder=None,
    on_started: Callable[[], None] | None = None,
) -> Starlette:
    """The ASGI app. ``engine`` is an ``AsyncLLMEngine``, ``registry`` a ``RegistryService``,
    ``adapters`` an ``AdapterManager``; any left out is built by ``builder(settings)`` at startup
    (default: ``components.build_components``). ``on_started`` runs once everything is built,
    before the first request (the entry point's process-wide settings). Bad parser or chat
    template settings are a ValueError (``new_context``)."""
    ctx = new_context(settings, engine=engine, registry=registry, adapters=adapters)
    lifecycle = ctx.lifecycle

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        steps = ShutdownSteps()
        try:
            await _start(app, steps)
        except BaseException:  # stop what had started, then exit with this error, as before
            await steps.run_after_failed_start()
            raise
        lifecycle.started = True
        log.info("ready: serving %s", ctx.served_model_name)
        try:
            yield
        finally:
            lifecycle.started = False
            errors = await steps.run()
            for name, exc in errors[1:]:
                log.error("stopping %s at shutdown failed", name, exc_info=exc)
            if errors:
                raise errors[0][1]

    async def _start(app: Starlette, steps: ShutdownSteps) -> None:
        """Each part's stop goes into ``steps`` as soon as it has started."""

        async def stop_usage() -> None:
            if ctx.usage is not None:
                await _stop_usage(ctx)

        # added first, so run last: by then every request has closed, so its usage is summed
        steps.add("usage accounting", stop_usage)
        if ctx.engine is None or ctx.registry is None or ctx.adapters is None:
            build = builder
            if build is None:
                from loraplex.server.components import build_components as build
            parts = await run_in_threadpool(build, settings, engine=ctx.engine, registry=ctx.registry, adapters=ctx.adapters)
        else:
            parts = Components(ctx.engine, ctx.registry, ctx.adapters)
        shutdown = getattr(parts.engine, "shutdown", None)
        if shutdown is not None:
            steps.add("engine", lambda: run_in_threadpool(shutdown))

        async def stop_tokenizer_thread() -> None:
            ctx.tokenizer_thread.shutdown(wait=False, cancel_futures=True)

        steps.add("tokenizer thread", stop_tokenizer_thread)
        use_parts(ctx, parts.engine, parts.registry, parts.adapters)
        fail_all = getattr(ctx.engine, "fail_all_requests", None)
        if fail_all is not None:  # the end of a drain's grace: its requests answer a 503 (lifecycle.py)
            lifecycle.add_cut_step(lambda: fail_all(grace_ended_error()))
        ctx.metrics.stats_source = ctx.engine_stats
        ctx.metrics.limit_replicas = lambda: ctx.live_replicas
        await run_in_threadpool(sweep_stale_staging, ctx.staging_root)  # uploads a crash cut short
        disk_cache = getattr(ctx.adapters, "disk_cache", None)
        if disk_cache is not None:
            ctx.metrics.disk_entries = lambda: disk_cache.stats()["entries"]
        app.state.blob_gc = None
        collect = getattr(ctx.adapters, "collect_garbage", None)
        if collect is not None and settings.blob_gc_interval_seconds > 0:
            blob_gc = BlobGarbageCollector(
                collect, settings.blob_gc_interval_seconds, settings.blob_gc_min_age_seconds
            ).start()
            app.state.blob_gc = blob_gc
            steps.add("blob garbage collection", lambda: run_in_threadpool(blob_gc.stop))
        record_usage = getattr(ctx.registry, "record_usage", None)
        if record_usage is not None and settings.usage_flush_seconds > 0:
            spool = UsageSpool(settings.home / USAGE_SPOOL_DIR)
            # its thread's first flush replays what an earlier run spooled
            ctx.usage = UsageRecorder(record_usage, settings.usage_flush_seconds, spool=spool).start()
            ctx.metrics.registry.register(UsageCollector(ctx.usage))
        if settings.registry_poll_seconds > 0 and hasattr(ctx.registry, "deleted_weights"):
            # deletes made through another replica: their weights leave this engine too
            watcher = await run_in_threadpool(watch_deletes, ctx, asyncio.get_running_loop(),
                                              settings.registry_poll_seconds)
            steps.add("registry watch", lambda: run_in_threadpool(watcher.stop))
        if settings.tenant_limits_scope == "cluster":  # the first heartbeat before the first request
            presence = ctx.presence = await run_in_threadpool(_start_presence, ctx)
            # first at shutdown: the others take over this replica's share; and already when a
            # drain starts, since this replica admits nothing new from then on
            steps.add("replica heartbeat", lambda: run_in_threadpool(presence.stop))
            lifecycle.add_drain_step(lambda: run_in_threadpool(presence.stop))
        if on_started is not None:
            on_started()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *openai_routes.routes(),
        *responses_routes.routes(),  # OpenAI's Responses API, stateless
        # SGLang's native API; its POST /generate hands LoRAX's bodies on to tgi_routes
        *sglang_routes.routes(),
        *tgi_routes.routes(),  # LoRAX's native API: /generate, /generate_stream, POST /
        *tgi_info.routes(),  # LoRAX's GET /info
        *tokenizer_routes.routes(),  # vLLM's /tokenize, /detokenize (LoRAX's /tokenize too)
        *admin_routes.routes(),
        *usage_routes.routes(),  # per-tenant usage for billing
        *tenant_delete_routes.routes(),  # offboarding: DELETE /admin/v1/tenants/{t}
    ]
    if settings.allow_runtime_lora_updating:  # off, vLLM's runtime LoRA routes do not exist (404)
        routes += runtime_lora_routes.routes() + sglang_lora_routes.routes()  # vLLM's, SGLang's
    admin_dir = admin_dir or DEFAULT_ADMIN_DIR
    if (admin_dir / "index.html").is_file():
        routes.append(Mount("/admin", app=StaticFiles(directory=admin_dir, html=True), name="admin-ui"))

    # CORS and the request ids outside the error handling, so that every answer carries them,
    # Starlette's 500s and the body-size check's 413s included (http_options.py)
    outer = [*http_options.cors_middleware(settings), Middleware(RequestIdMiddleware)]
    app = http_options.ServerApp(routes=routes, exception_handlers=exception_handlers(), lifespan=lifespan,
                                 outer_middleware=outer)
    app.state.ctx = ctx
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(HttpMetricsMiddleware, metrics=ctx.metrics)
    return app
