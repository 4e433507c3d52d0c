"""Deletes made through another replica reach this replica's engine.

A delete (of a version, an adapter, a tenant) drops the weights no live version uses any more
from the engine of the replica that took it (``admin_routes.drop_weights_if_unused``): device
slots, host cache and pins. The other replicas share only the database. Each watches the
registry's change counter (``watch.RegistryWatcher``, every ``registry_poll_seconds``), which
every delete bumps; when it moves, the weights this engine holds that no live version has any
more (``RegistryService.deleted_weights``) go the same way, with their local copy, and so do
the local copies of such weights that the engine no longer holds. Without it a
pin taken on another replica held its device slot until that replica restarted, and nothing
could unpin it (the name no longer resolved).

Requests still running on such weights finish on them, as on the replica that took the
delete. Weights being retired already are not swept again. A poll that fails (database down)
is logged and retried at the next tick.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.concurrency import run_in_threadpool

from loraplex.registry.watch import RegistryWatcher
from loraplex.server.admin_routes import drop_weights_if_unused, engine_adapters
from loraplex.server.context import AppContext
from loraplex.storage.base import content_key

log = logging.getLogger("loraplex.server")

SWEEP_TIMEOUT_SECONDS = 60.0  # the watcher thread waits at most this long for one sweep


async def drop_weights_deleted_elsewhere(ctx: AppContext) -> list[str]:
    """Drop the weights that no live version has any more from the engine, where it holds them,
    and from the local disk cache; returns the content hashes of those dropped."""
    held = [h for h, entry in engine_adapters(ctx.engine_stats()).items() if not entry.get("retiring")]
    disk_cache = getattr(ctx.adapters, "disk_cache", None)
    cached = disk_cache.content_hashes() if disk_cache is not None else []
    candidates = sorted(set(held) | set(cached))
    gone = sorted(await run_in_threadpool(ctx.registry.deleted_weights, candidates)) if candidates else []
    held_set, dropped = set(held), []
    for content_hash in gone:
        removed = False
        if content_hash in held_set:
            await drop_weights_if_unused(ctx, content_hash, content_key(content_hash))
            removed = True
        if disk_cache is not None:  # its local copy too, unless a running request holds it (LRU later)
            removed = await run_in_threadpool(disk_cache.remove, content_hash) or removed
        if removed:
            dropped.append(content_hash)
    if dropped:
        log.info("dropped %d adapter(s) whose versions were deleted (through another replica): %s",
                 len(dropped), ", ".join(h[:12] for h in dropped))
    return dropped


def watch_deletes(ctx: AppContext, loop: asyncio.AbstractEventLoop, interval_seconds: float) -> RegistryWatcher:
    """Start the watcher whose change callback runs ``drop_weights_deleted_elsewhere`` on
    ``loop`` (the server's), waiting for it, so sweeps never overlap."""

    def on_change(_counter: int) -> None:
        future = asyncio.run_coroutine_threadsafe(drop_weights_deleted_elsewhere(ctx), loop)
        future.result(SWEEP_TIMEOUT_SECONDS)

    return RegistryWatcher(ctx.registry, interval_seconds, on_change).start()
