"""Admin API under ``/admin/v1`` (admin bearer key): tenants and their serving limits, keys,
adapter versions, hot-swap, load/pin/unload, delete, status and the audit log. Backed by the
registry service, the adapter manager (uploads, blobs, in-use tracking) and the engine
(device/host tiers)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loraplex.registry.errors import NotFound
from loraplex.registry.info import VersionInfo
from loraplex.registry.names import parse_version
from loraplex.server.context import AppContext
from loraplex.server.errors import APIError, bad_request
from loraplex.server.limits import parse_json, read_body
from loraplex.server.merged_adapters import forget_merges
from loraplex.server.uploads import new_staging_dir, remove_staging, stage_upload
from loraplex.storage.base import content_key

ACTOR = "admin"
log = logging.getLogger("loraplex.server")


def _ctx(request: Request) -> AppContext:
    return request.app.state.ctx


async def _admin(request: Request) -> AppContext:
    ctx = _ctx(request)
    await ctx.admin_auth.require(request)
    return ctx


async def _json(request: Request, ctx: AppContext, fields: tuple[str, ...] | None = None) -> dict:
    """The body's JSON object (``{}`` when empty); with ``fields``, a field not among them is a
    400 naming it, so a misspelt option (``"pinned"`` for ``"pin"``) is not silently left out."""
    raw = await read_body(request, ctx.settings.max_body_bytes)
    if not raw:
        return {}
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object.")
    unknown = sorted(set(body) - set(fields)) if fields is not None else []
    if unknown:
        raise bad_request(f"unknown field {unknown[0]!r}; this call takes {', '.join(map(repr, fields))}",
                          param=unknown[0])
    return body


def _version(value: object) -> int:
    """A version number from the body or the path, or a 400 naming ``version``."""
    try:
        return parse_version(value)
    except ValueError as exc:  # InvalidName
        raise bad_request(str(exc), param="version") from None


def _not_found(what: str) -> APIError:
    return APIError(404, f"{what} not found", code="not_found")


# --- tenants and keys -------------------------------------------------------------------------


async def create_tenant(request: Request) -> Response:
    ctx = await _admin(request)
    name = (await _json(request, ctx, ("name",))).get("name")
    if not isinstance(name, str):
        raise bad_request("`name` must be a string", param="name")
    info = await run_in_threadpool(ctx.registry.create_tenant, name, ACTOR)
    return JSONResponse(info.to_dict(), status_code=201)


async def list_tenants(request: Request) -> Response:
    ctx = await _admin(request)
    tenants = await run_in_threadpool(ctx.registry.list_tenants)
    return JSONResponse({"object": "list", "data": [t.to_dict() for t in tenants]})


async def get_tenant(request: Request) -> Response:
    ctx = await _admin(request)
    name = request.path_params["tenant"]
    info = await run_in_threadpool(ctx.registry.get_tenant, name)
    if info is None:
        raise _not_found(f"tenant {name!r}")
    return JSONResponse(info.to_dict())


async def update_tenant(request: Request) -> Response:
    """Any of ``max_concurrent_requests``, ``scheduling_weight``, ``max_requests_per_minute``
    and ``max_tokens_per_minute``; the registry checks each (a 400 naming the field changes
    nothing) and audits the change."""
    ctx = await _admin(request)
    name = request.path_params["tenant"]
    changes = await _json(request, ctx)
    info = await run_in_threadpool(ctx.registry.update_tenant_settings, name, changes, ACTOR)
    ctx.tenant_limits.forget(name)  # this replica at once; the others within registry_poll_seconds
    return JSONResponse(info.to_dict())


async def create_key(request: Request) -> Response:
    ctx = await _admin(request)
    info, secret = await run_in_threadpool(ctx.registry.create_api_key, request.path_params["tenant"], ACTOR)
    return JSONResponse({**info.to_dict(), "key": secret}, status_code=201)


async def list_keys(request: Request) -> Response:
    ctx = await _admin(request)
    keys = await run_in_threadpool(ctx.registry.list_api_keys, request.path_params["tenant"])
    return JSONResponse({"object": "list", "data": [k.to_dict() for k in keys]})


async def revoke_key(request: Request) -> Response:
    ctx = await _admin(request)
    p = request.path_params
    info = await run_in_threadpool(ctx.registry.revoke_api_key, p["tenant"], p["key_id"], ACTOR)
    ctx.tenant_auth.forget_all()  # effective at once in this process
    return JSONResponse(info.to_dict())


# --- adapters ---------------------------------------------------------------------------------


def _version_dict(ctx: AppContext, v, stats: dict) -> dict:
    d = v.to_dict()
    d["tier"] = adapter_tier(ctx, v.sha256, stats)
    entry = engine_adapters(stats).get(v.sha256) or {}
    d["pinned"] = bool(entry.get("pinned", False))
    usage = adapter_usage(stats, v.sha256)
    d["requests"] = usage.get("requests", 0)
    d["tokens"] = usage.get("tokens", 0)
    return d


def _adapter_dict(ctx: AppContext, a, stats: dict) -> dict:
    versions = [_version_dict(ctx, v, stats) for v in a.versions]
    active = next((v for v in versions if v["version"] == a.active_version), None)
    return {
        "tenant": a.tenant,
        "name": a.name,
        "active_version": a.active_version,
        "created_at": a.to_dict()["created_at"],
        "origin": a.origin,  # "runtime_load": made by /v1/load_lora_adapter (the tenant may unload it)
        "tier": active["tier"] if active else None,
        "pinned": bool(active and active["pinned"]),
        "requests": sum(v["requests"] for v in versions),
        "tokens": sum(v["tokens"] for v in versions),
        "versions": versions,
    }


def engine_adapters(stats: dict) -> dict:
    """The engine's record of each adapter it holds, by content hash (``stats``: the engine's,
    its LoRA part under ``lora``, or that part itself)."""
    lora = stats.get("lora")
    per = (lora if isinstance(lora, dict) else stats).get("adapters")
    return per if isinstance(per, dict) else {}


def adapter_usage(stats: dict, content_hash: str) -> dict:
    entry = engine_adapters(stats).get(content_hash)
    if not isinstance(entry, dict):
        return {}
    tokens = entry.get("tokens")
    if tokens is None:
        tokens = int(entry.get("prompt_tokens", 0)) + int(entry.get("gen_tokens", entry.get("generation_tokens", 0)))
    return {"requests": int(entry.get("requests", 0)), "tokens": int(tokens)}


def adapter_tier(ctx: AppContext, content_hash: str, stats: dict) -> str:
    """Closest tier holding this version: device, host (engine), disk (local cache), store."""
    entry = engine_adapters(stats).get(content_hash)
    if isinstance(entry, dict) and entry.get("tier") in ("device", "host"):
        return entry["tier"]
    tier_of = getattr(ctx.adapters, "tier_of", None)
    if tier_of is not None:
        try:
            tier = tier_of(content_hash)
            if tier in ("disk", "store", "device", "host"):
                return tier
        except Exception:
            pass
    return "store"


async def list_adapters(request: Request) -> Response:
    ctx = await _admin(request)
    adapters = await run_in_threadpool(ctx.registry.list_adapters, request.path_params["tenant"])
    stats = ctx.engine_stats()
    return JSONResponse({"object": "list", "data": [_adapter_dict(ctx, a, stats) for a in adapters]})


async def _get_adapter(ctx: AppContext, tenant: str, name: str):
    info = await run_in_threadpool(ctx.registry.get_adapter, tenant, name)
    if info is None:
        raise _not_found(f"adapter {name!r} of tenant {tenant!r}")
    return info


async def get_adapter(request: Request) -> Response:
    ctx = await _admin(request)
    p = request.path_params
    info = await _get_adapter(ctx, p["tenant"], p["name"])
    return JSONResponse(_adapter_dict(ctx, info, ctx.engine_stats()))


async def upload_version(request: Request) -> Response:
    ctx = await _admin(request)
    p = request.path_params
    if await run_in_threadpool(ctx.registry.get_tenant, p["tenant"]) is None:
        raise _not_found(f"tenant {p['tenant']!r}")
    if "multipart/form-data" not in request.headers.get("content-type", ""):
        raise bad_request("upload must be multipart/form-data", param="content-type")
    staging = new_staging_dir(ctx.staging_root)
    try:
        with ctx.lifecycle.admitted():  # a drain waits for it (a new one, once draining, is a 503)
            async with request.form(max_files=8, max_fields=16) as form:
                peft_dir = await stage_upload(form, staging, ctx.settings.max_upload_member_bytes)
            warnings: list[str] = []
            version, created = await run_in_threadpool(
                ctx.adapters.upload, p["tenant"], p["name"], peft_dir, ACTOR, warnings=warnings
            )
    finally:
        remove_staging(staging)
    body = {**version.to_dict(), "created": created}
    if warnings:  # e.g. LoRA on a vision tower this deployment never runs (accepted, ignored)
        body["warnings"] = warnings
    return JSONResponse(body, status_code=201 if created else 200)


async def activate(request: Request) -> Response:
    ctx = await _admin(request)
    p = request.path_params
    version = _version((await _json(request, ctx, ("version",))).get("version"))
    info = await run_in_threadpool(ctx.registry.activate, p["tenant"], p["name"], version, ACTOR)
    return JSONResponse(info.to_dict())


async def load(request: Request) -> Response:
    ctx = await _admin(request)
    p = request.path_params
    body = await _json(request, ctx, ("tier", "pin", "version"))
    tier = body.get("tier", "device")
    pin = body.get("pin", False)
    if tier not in ("device", "host"):
        raise bad_request("`tier` must be \"device\" or \"host\"", param="tier")
    if not isinstance(pin, bool):
        raise bad_request("`pin` must be a boolean", param="pin")
    ref_name = p["name"] if body.get("version") is None else f"{p['name']}@{_version(body['version'])}"
    # acquired while the engine reads the files: neither eviction nor a delete removes them
    ref = await run_in_threadpool(lambda: ctx.adapters.resolve(p["tenant"], ref_name, acquire=True))
    try:
        await ctx.engine.load_adapter(ref, tier=tier, pin=pin)
        try:  # a delete that landed meanwhile found nothing to unload yet: drop what we loaded
            await run_in_threadpool(ctx.registry.resolve, p["tenant"], ref.name)
        except NotFound:
            await drop_weights_if_unused(ctx, ref.content_hash, content_key(ref.content_hash))
            raise
    finally:
        ctx.adapters.release(ref.content_hash)
    ctx.adapter_display[ref.content_hash] = f"{p['tenant']}/{ref.name}"
    await run_in_threadpool(
        ctx.registry.record_event, ACTOR, "adapter.load", p["tenant"], "adapter", ref.name,
        {"tier": tier, "pin": pin, "sha256": ref.content_hash},
    )
    return JSONResponse({"adapter": ref.name, "sha256": ref.content_hash, "tier": tier, "pinned": pin})


async def unload(request: Request) -> Response:
    ctx = await _admin(request)
    p = request.path_params
    info = await _get_adapter(ctx, p["tenant"], p["name"])
    known = engine_adapters(ctx.engine_stats())
    unloaded = []
    for v in info.versions:  # every version of the name: drop from device and host
        # unconditionally: the stats may predate a load that just finished (unknown ids are a no-op)
        await ctx.engine.unload_adapter(v.sha256)
        if v.sha256 in known:
            unloaded.append(v.version)
    await run_in_threadpool(
        ctx.registry.record_event, ACTOR, "adapter.unload", p["tenant"], "adapter", p["name"], {"versions": unloaded}
    )
    return JSONResponse({"adapter": p["name"], "unloaded": unloaded})


async def delete_adapter(request: Request) -> Response:
    ctx = await _admin(request)
    p = request.path_params
    if hasattr(ctx.adapters, "delete_adapter"):
        removed = await run_in_threadpool(ctx.adapters.delete_adapter, p["tenant"], p["name"], ACTOR)
    else:
        removed = await run_in_threadpool(ctx.registry.delete_adapter, p["tenant"], p["name"], ACTOR)
    await drop_unused_from_engine(ctx, removed or [])
    return JSONResponse({"deleted": [v.to_dict() for v in removed or []]})


async def delete_version(request: Request) -> Response:
    ctx = await _admin(request)
    p = request.path_params
    version = _version(p["version"])
    if hasattr(ctx.adapters, "delete_version"):
        removed = await run_in_threadpool(ctx.adapters.delete_version, p["tenant"], p["name"], version, ACTOR)
    else:
        removed = await run_in_threadpool(ctx.registry.delete_version, p["tenant"], p["name"], version, ACTOR)
    await drop_unused_from_engine(ctx, removed or [])
    return JSONResponse({"deleted": [v.to_dict() for v in removed or []]})


async def drop_unused_from_engine(ctx: AppContext, removed: Iterable[VersionInfo]) -> None:
    """``drop_weights_if_unused`` for each deleted version."""
    for version in removed:
        await drop_weights_if_unused(ctx, version.sha256, version.blob_key, f"{version.tenant}/{version.ref}")


async def drop_weights_if_unused(ctx: AppContext, content_hash: str, blob_key: str, label: str | None = None) -> None:
    """Deleted weights that no live version of any tenant uses any more leave the engine's device
    slots and host cache, pins included (else a pinned slot would stay taken until a restart).
    Requests still running on them reload them from their local copy, which stays until the last
    of them ends; weights another version still uses (same content hash) are left alone, but lose
    their status-page name when it was ``label``, the deleted version's (a request naming a live
    version names them again). Merges built from unused weights (LoRAX's merged_adapters) go too,
    with their files, records and names."""
    try:
        if await run_in_threadpool(ctx.registry.versions_using_blob, blob_key) > 0:
            if label is not None and ctx.adapter_display.get(content_hash) == label:
                ctx.adapter_display.pop(content_hash, None)
            return
        await _retire(ctx, content_hash)
        merges = await run_in_threadpool(ctx.merges.drop_merges_of, content_hash) if ctx.merges else []
        for merged in merges:
            await ctx.engine.unload_adapter(merged)
        if merges:  # nothing can name them again: their records and names go too
            kept = await forget_merges(ctx, merges)
            for merged in kept:  # a request still runs on it: the engine forgets it after
                await _retire(ctx, merged)
            ctx.merges.hand_back(kept)  # its names: a later merge request's housekeeping
    except Exception:  # noqa: BLE001 - the delete itself is done; LRU eviction frees it later
        log.exception("could not drop deleted adapter %s from the engine", content_hash)


async def _retire(ctx: AppContext, content_hash: str) -> None:
    """Weights nobody can name any more leave the engine, and its record and stats with them
    once no request holds them (``retire_adapter``); gone now, their names on the status page
    and the metrics labels go too (a request still running keeps them until the next delete)."""
    retire = getattr(ctx.engine, "retire_adapter", None)
    if retire is None:  # an engine without a record of each adapter
        await ctx.engine.unload_adapter(content_hash)
        return
    if await retire(content_hash):
        ctx.metrics.hash_labels.pop(content_hash, None)
        ctx.adapter_display.pop(content_hash, None)


# --- status and audit -------------------------------------------------------------------------


async def status(request: Request) -> Response:
    ctx = await _admin(request)
    stats = ctx.engine_stats()
    running, waiting = ctx.metrics.lora_adapters(stats)
    body = {
        "model": ctx.served_model_name,
        "max_model_len": ctx.max_model_len,
        "ready": ctx.lifecycle.started and not ctx.lifecycle.draining,
        "draining": ctx.lifecycle.draining,
        "in_flight": ctx.lifecycle.in_flight,
        **ctx.metrics.summary(),
        "running_lora_adapters": running,
        "waiting_lora_adapters": waiting,
        "engine": _jsonable(stats),
        "adapter_names": dict(ctx.adapter_display),
        "usage_accounting": None if ctx.usage is None else ctx.usage.stats(),  # None: off
        # what requests leaving sampling fields unset get (--generation-config); {} : the library's
        "sampling_defaults": ctx.sampling_defaults.to_dict() if ctx.sampling_defaults else {},
    }
    return JSONResponse(body)


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


async def audit(request: Request) -> Response:
    ctx = await _admin(request)
    tenant = request.query_params.get("tenant") or None
    limit = request.query_params.get("limit", "100")
    if not limit.isdigit() or not 1 <= int(limit) <= 1000:
        raise bad_request("`limit` must be an integer in [1, 1000]", param="limit")
    events = await run_in_threadpool(ctx.registry.list_audit, tenant, int(limit))
    return JSONResponse({"object": "list", "data": [e.to_dict() for e in events]})


def routes() -> list[Route]:
    a = "/admin/v1"
    t = a + "/tenants/{tenant}"
    ad = t + "/adapters/{name}"
    return [
        Route(a + "/tenants", create_tenant, methods=["POST"]),
        Route(a + "/tenants", list_tenants, methods=["GET"]),
        Route(t, get_tenant, methods=["GET"]),
        Route(t, update_tenant, methods=["PATCH"]),
        Route(t + "/keys", create_key, methods=["POST"]),
        Route(t + "/keys", list_keys, methods=["GET"]),
        Route(t + "/keys/{key_id}", revoke_key, methods=["DELETE"]),
        Route(t + "/adapters", list_adapters, methods=["GET"]),
        Route(ad, get_adapter, methods=["GET"]),
        Route(ad, delete_adapter, methods=["DELETE"]),
        Route(ad + "/versions", upload_version, methods=["POST"]),
        Route(ad + "/versions/{version}", delete_version, methods=["DELETE"]),
        Route(ad + "/active", activate, methods=["PUT"]),
        Route(ad + "/load", load, methods=["POST"]),
        Route(ad + "/unload", unload, methods=["POST"]),
        Route(a + "/status", status, methods=["GET"]),
        Route(a + "/audit", audit, methods=["GET"]),
    ]
