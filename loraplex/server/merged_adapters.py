"""LoRAX's ``parameters.merged_adapters`` on ``/generate``: the field read and checked, and the
merge resolved to the request's adapter (``AdapterMerger``, loraplex/registry/adapter_merges.py).

``{"ids": [...], "weights": [...], "merge_strategy": "linear" | "ties" | "dare_linear" |
"dare_ties", "density": 0..1, "majority_sign_method": "total" | "frequency"}`` with LoRAX's
defaults (predibase/lorax ``router/src/lib.rs`` ``AdapterParameters``, ``clients/python/lorax/
types.py`` ``MergedAdapters``): weights all 1 when absent or empty, ``linear``, ``total``. The ids
name the caller's tenant's adapters as ``adapter_id`` does (``name`` or ``name@N``). As
lorax-client says, a request gives at most one of ``adapter_id`` and ``merged_adapters``.
``density`` is required by ``ties`` and the ``dare_*`` strategies (LoRAX's docs; its server
would take a missing one as 0 and prune everything) and must be in (0, 1] there; ``linear``
ignores it, as LoRAX does, within the client's [0, 1].
A single id is merged ``linear`` whatever the strategy (PEFT's rule): its update is scaled by
its weight, never pruned.
"""

from __future__ import annotations

import asyncio
import logging
import math

from starlette.concurrency import run_in_threadpool

from loraplex.lora.errors import InvalidAdapterError
from loraplex.lora.merge import MAJORITY_SIGN_METHODS, MERGE_STRATEGIES, USES_DENSITY, USES_SIGN_METHOD, MergeParams
from loraplex.registry.adapter_merges import MergeBusy, UnknownAdapter
from loraplex.server.body_fields import as_float, is_number
from loraplex.server.errors import APIError, bad_request, clipped
from loraplex.server.generation import Target
from loraplex.server.rate_limits import TokenCost

log = logging.getLogger("loraplex.server")

FIELD = "merged_adapters"
MAX_MERGED_ADAPTERS = 16  # adapters held in host memory at once while a merge is built
MERGED_LABEL = "+merged"  # metrics and access-log name of every merge (no adapter name has a "+")


def _bad(message: str) -> APIError:
    return bad_request(f"`{FIELD}`: {message}", param=FIELD)


def parse_merged_adapters(value) -> tuple[tuple[str, ...], MergeParams]:
    """``(ids, params)`` of a request's ``merged_adapters`` object; a 400 (LoRAX's 422) naming the
    field for anything wrong."""
    if not isinstance(value, dict):
        raise _bad("must be an object with `ids` and `weights`")
    ids = value.get("ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) and i for i in ids):
        raise _bad("`ids` must be a non-empty list of adapter names")
    if len(ids) > MAX_MERGED_ADAPTERS:
        raise _bad(f"at most {MAX_MERGED_ADAPTERS} adapters can be merged, got {len(ids)}")
    weights = value.get("weights")
    if weights is None or weights == []:
        weights = [1.0] * len(ids)  # LoRAX's server: every adapter weighs 1
    if not isinstance(weights, list) or not all(is_number(w) and math.isfinite(as_float(w)) for w in weights):
        raise _bad("`weights` must be a list of finite numbers")
    if len(weights) != len(ids):
        raise _bad(f"`ids` and `weights` must have the same length ({len(ids)} ids, {len(weights)} weights)")
    strategy = value.get("merge_strategy")
    strategy = "linear" if strategy is None else strategy
    if strategy not in MERGE_STRATEGIES:
        raise _bad(f"`merge_strategy` must be one of {list(MERGE_STRATEGIES)}, got {strategy!r}")
    sign = value.get("majority_sign_method")
    sign = "total" if sign is None else sign
    if sign not in MAJORITY_SIGN_METHODS:
        raise _bad(f"`majority_sign_method` must be one of {list(MAJORITY_SIGN_METHODS)}, got {sign!r}")
    density = value.get("density")
    if density is not None and not (is_number(density) and 0.0 <= density <= 1.0):
        raise _bad(f"`density` must be a number in [0, 1], got {density!r}")
    if strategy in USES_DENSITY:
        if density is None or density <= 0.0:
            raise _bad(f"`density` in (0, 1] is required by `merge_strategy` {strategy!r}: "
                       "the fraction of each adapter's weights kept")
        density = float(density)
    else:
        density = None  # linear: no pruning, so equal merges share one key
    params = MergeParams(strategy, tuple(float(w) for w in weights), density,
                         sign if strategy in USES_SIGN_METHOD else None)
    return tuple(ids), params.for_count(len(ids))  # one id: linear (PEFT), one cache key with it


async def resolve_merged_target(ctx, tenant: str, ids: tuple[str, ...], params: MergeParams) -> Target:
    """The request's ``Target``: the merge of ``tenant``'s adapters ``ids``, acquired (the run
    releases it). A name the tenant does not have is LoRAX's 404, a merge that cannot be made a
    400 (LoRAX's 422) naming the field."""
    merger = getattr(ctx, "merges", None)
    if merger is None:
        raise bad_request(f"`{FIELD}`: merging adapters needs the server's adapter store (not served here)",
                          param=FIELD, code="unsupported_parameter")
    refuse_as_admission_would(ctx, tenant, await ctx.tenant_limits.get(tenant))
    try:
        merged = await _resolve_after_identical_ones(ctx, merger, tenant, ids, params)
    except Exception as exc:
        if isinstance(exc, MergeBusy):
            raise APIError(429, f"`{FIELD}`: this tenant already has {exc.limit} other merge(s) being built; "
                                "retry once it is done (a merge is built once, then reused)",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
        if isinstance(exc, UnknownAdapter):  # another tenant's adapter: the same answer as none
            raise APIError(404, f"Adapter `{clipped(exc.ref)}` does not exist or you do not have access to it.",
                           code="adapter_not_found") from None
        if isinstance(exc, InvalidAdapterError) and getattr(exc, "http_status", 400) == 400:  # MergeError too
            raise _bad(exc.message) from None
        raise
    await drop_forgotten_merges(ctx, merger)
    ref = merged.ref
    names = ",".join(ids)
    ctx.adapter_display[ref.content_hash] = f"{tenant}/{MERGED_LABEL}({names})"
    ctx.metrics.hash_labels[ref.content_hash] = f"{tenant}/{MERGED_LABEL}"
    return Target(model=names, adapter=ref, label=f"{tenant}/{MERGED_LABEL}", version=None,
                  after_release=lambda: drop_forgotten_merges_soon(ctx, merger))


async def _resolve_after_identical_ones(ctx, merger, tenant: str, ids: tuple[str, ...], params: MergeParams):
    """``merger.resolve`` on a thread, once any identical request resolving now is done (its
    build then serves this one from the cache in a moment). Without this, each identical request
    would wait for a long build inside ``resolve``, holding one of the thread pool's threads
    (40) that every route's blocking work shares."""
    key = (tenant, ids, params)
    while (pending := ctx.merges_resolving.get(key)) is not None:
        await asyncio.wait([pending])
    done = asyncio.get_running_loop().create_future()
    ctx.merges_resolving[key] = done
    try:
        return await run_in_threadpool(merger.resolve, tenant, list(ids), params)
    finally:
        del ctx.merges_resolving[key]
        done.set_result(None)


def refuse_as_admission_would(ctx, tenant: str, limits) -> None:
    """Raise the refusal ``RequestRun.admit`` would give now (503 draining, 429 the tenant's
    concurrency cap or requests / tokens per minute), taking nothing: a merge is built before
    admission (the run needs its adapter), so without this a tenant over its limits, or any
    tenant of a draining server, could still spend CPU and disk on builds, and push out its own
    remembered merges, with every refused request. Admission checks again, as always."""
    ctx.lifecycle.admit()
    ctx.lifecycle.done()
    replicas = ctx.live_replicas
    ctx.limiter.acquire(tenant, limits.concurrency_cap(replicas))
    ctx.limiter.release(tenant)
    # one request and one token: whatever the prompt, a bucket that cannot give these refuses
    ctx.rate_limiter.cancel(ctx.rate_limiter.reserve(
        tenant, limits.max_requests_per_minute, limits.max_tokens_per_minute, TokenCost(1, 0, 0), replicas=replicas))


async def drop_forgotten_merges(ctx, merger) -> None:
    """Merges the merger stopped remembering (past its per-tenant or global bound) and nobody
    holds leave the engine (catalog record, stats, tiers) and the status page's names, so a
    tenant sending ever new weights cannot grow the server's memory. One the engine still runs
    is handed back by a later call."""
    forgotten = merger.take_forgotten()
    if not forgotten:
        return
    try:
        kept = await forget_merges(ctx, forgotten)
    except Exception:  # noqa: BLE001 - housekeeping: the request (holding its merge) goes on
        log.exception("could not drop %d forgotten merges from the engine", len(forgotten))
        kept = set(forgotten)
    merger.hand_back(kept)


def drop_forgotten_merges_soon(ctx, merger) -> None:
    """After a run let go of its merge: if the merger has forgotten merges waiting (this one,
    when a constituent was deleted while it was built; or one past the bounds that this run
    held), drop them on the event loop now rather than at the next merge request, which may
    never come."""
    if not merger.stats()["forgotten_pending"]:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # released off the loop (no run does so today): the next request drops them
        return
    task = loop.create_task(drop_forgotten_merges(ctx, merger))
    ctx.housekeeping_tasks.add(task)  # held until done: the loop keeps only a weak reference
    task.add_done_callback(ctx.housekeeping_tasks.discard)


async def forget_merges(ctx, content_hashes: list[str]) -> set[str]:
    """Drop merges nobody can name any more from the engine (``forget_adapters``) and from the
    status page's and metrics' names; returns those the engine still runs (left as they are)."""
    forget = getattr(ctx.engine, "forget_adapters", None)
    kept = set(await forget(content_hashes)) if forget is not None else set()
    rebuilt = ctx.merges.remembered_hashes()  # asked for again meanwhile: its names stay
    for content_hash in content_hashes:
        if content_hash in kept or content_hash in rebuilt:
            continue
        label = ctx.metrics.hash_labels.get(content_hash, "")
        if label.endswith(f"/{MERGED_LABEL}"):  # not an uploaded adapter with the same weights
            ctx.metrics.hash_labels.pop(content_hash, None)
            ctx.adapter_display.pop(content_hash, None)
    return kept
