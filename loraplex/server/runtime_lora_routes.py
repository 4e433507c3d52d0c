"""vLLM's runtime LoRA endpoints, per tenant: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (and under ``/t/{tenant}/v1``).

vLLM serves them only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``; loraplex only with
``--allow-runtime-lora-updating`` (or that variable, read at the entry point). Left off, the
routes do not exist and answer 404, as vLLM's do.

A tenant key acts on its own tenant, and only on the adapters these endpoints created there
(``Adapter.origin``, see loraplex/registry/adapter_origin.py): the operator's adapters (admin API,
CLI, ``--lora-modules``) are refused with 403 ``adapter_managed_by_operator`` and left unchanged,
both for an unload and for a ``load_inplace`` over one; an operator upload to a runtime-loaded
adapter makes it the operator's. Load registers the directory as an upload does (same checks,
content hash and blob; identical weights add no version) and makes it the name's active version.
The directory is on the server's disk, which tenants must not browse: only paths under a
``--lora-path-root`` are read, after symlinks are resolved, and any other path gets one 403 that
does not say whether it exists. The files are read through descriptors checked against the same
roots, so a link swapped in after the path check is refused too. Unload deletes the tenant's
adapter as the admin delete does: new requests stop resolving it at once, running ones finish on
their copy.

Answers follow vLLM: 200 with a short text on success; ``{"error": {"message", "type", "param",
"code"}}`` with vLLM's type names and messages for a missing field (400), a name already loaded
(400; vLLM's ``load_inplace: true`` loads a new version over it) and an unknown name (404).
Everything else is loraplex's error envelope (a refused adapter: 400 naming the reason).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from loraplex.lora.snapshot import OutsideAllowedPaths, adapter_snapshot
from loraplex.registry.adapter_upload import ADAPTER_FILES
from loraplex.registry.errors import AlreadyExists, InvalidName, ManagedByOperator, NotFound
from loraplex.registry.models import ADAPTER_ORIGIN_RUNTIME
from loraplex.server.admin_routes import drop_unused_from_engine
from loraplex.server.context import AppContext
from loraplex.server.errors import APIError, bad_request
from loraplex.server.limits import parse_json, read_body

LOAD_ACTOR = "load_lora_adapter"
UNLOAD_ACTOR = "unload_lora_adapter"
PATH_REFUSED = (
    "`lora_path` must be an absolute path inside a directory this server loads adapters from "
    "(--lora-path-root)."
)


def vllm_error(status: int, message: str) -> APIError:
    """vLLM's error for these endpoints: its exception type name, and the status as ``code``."""
    kind = {400: "BadRequestError", 404: "NotFoundError"}[status]
    return APIError(status, message, type=kind, code=status)


def managed_by_operator(name: str) -> APIError:
    """A runtime load in place or unload of an adapter the operator manages: nothing changed."""
    return APIError(
        403,
        f"The lora adapter '{name}' was not loaded through /v1/load_lora_adapter: it is managed by the "
        "operator (admin API, `loraplex adapters`, or --lora-modules) and cannot be replaced or unloaded "
        "through the runtime LoRA endpoints.",
        param="lora_name", code="adapter_managed_by_operator",
    )


def already_loaded(name: str) -> APIError:
    """vLLM's answer to a load, without ``load_inplace``, of a name that is loaded."""
    return vllm_error(400, f"The lora adapter '{name}' has already been loaded.")


def path_refused() -> APIError:
    """One answer for every path outside the roots, existing or not."""
    return APIError(403, PATH_REFUSED, param="lora_path", code="lora_path_not_allowed")


def allowed_path(lora_path: str, roots: list[Path]) -> Path | None:
    """``lora_path`` with symlinks resolved when it, and the adapter files in it, lie inside one
    of ``roots``; else None. Decided on the path's text and links alone: existence is checked
    later, by the upload."""
    if not os.path.isabs(lora_path):
        return None
    try:
        inside = roots_check(roots)
        real = Path(os.path.realpath(lora_path))
        # a file linked out of the roots would be read too (its parse errors could echo it)
        if not inside(real) or not all(inside(real / name) for name in ADAPTER_FILES):
            return None
        return real
    except (OSError, ValueError):  # an embedded NUL byte, a loop of links
        return None


def roots_check(roots: list[Path]) -> Callable[[str | Path], bool]:
    """Whether a path, links resolved, lies inside one of ``roots``."""
    real_roots = [os.path.realpath(root) for root in roots]

    def inside(path: str | Path) -> bool:
        return any(Path(os.path.realpath(path)).is_relative_to(root) for root in real_roots)

    return inside


def _upload_confined(ctx: AppContext, tenant: str, name: str, real: Path, create_only: bool) -> None:
    """Upload from a copy of the files read where the path check allowed: a link swapped in
    after ``allowed_path`` (by anyone who can write under a root) is refused, not followed."""
    adapters = ctx.adapters
    with adapter_snapshot(real, adapters.max_member_bytes, roots_check(ctx.settings.lora_path_roots),
                          temp_root=ctx.staging_root) as copy:
        adapters.upload_active(tenant, name, copy, LOAD_ACTOR, origin=ADAPTER_ORIGIN_RUNTIME, create_only=create_only)


async def _tenant_and_body(request: Request) -> tuple[AppContext, str, dict]:
    ctx: AppContext = request.app.state.ctx
    tenant = await ctx.tenant_auth.tenant_for(request, request.path_params.get("tenant"))
    body = parse_json(await read_body(request, ctx.settings.max_body_bytes) or b"{}")
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object.")
    return ctx, tenant, body


async def load_lora_adapter(request: Request) -> Response:
    ctx, tenant, body = await _tenant_and_body(request)
    name, path, inplace = body.get("lora_name"), body.get("lora_path"), body.get("load_inplace", False)
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise vllm_error(400, "Both 'lora_name' and 'lora_path' must be provided.")
    if not isinstance(inplace, bool):
        raise bad_request("`load_inplace` must be a boolean", param="load_inplace")
    real = allowed_path(path, ctx.settings.lora_path_roots)
    if real is None:
        raise path_refused()
    try:
        existing = await run_in_threadpool(ctx.registry.get_adapter, tenant, name)
    except InvalidName as exc:
        raise bad_request(str(exc), param="lora_name") from None
    if existing is not None and not inplace:
        raise already_loaded(name)
    if existing is not None and existing.origin != ADAPTER_ORIGIN_RUNTIME:
        raise managed_by_operator(name)  # before reading the files; the upload checks again, atomically
    try:
        with ctx.lifecycle.admitted():  # a drain waits for it
            await run_in_threadpool(_upload_confined, ctx, tenant, name, real, not inplace)
    except AlreadyExists:  # another load of the name landed since the check above
        raise already_loaded(name) from None
    except OutsideAllowedPaths:
        raise path_refused() from None
    except ManagedByOperator:  # the operator uploaded it since the check above
        raise managed_by_operator(name) from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    ctx, tenant, body = await _tenant_and_body(request)
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise vllm_error(400, "'lora_name' needs to be provided to unload a LoRA adapter.")
    try:
        removed = await run_in_threadpool(ctx.adapters.delete_adapter, tenant, name, UNLOAD_ACTOR,
                                          ADAPTER_ORIGIN_RUNTIME)
    except (NotFound, InvalidName):  # another tenant's adapter is not found either
        raise vllm_error(404, f"The lora adapter '{name}' cannot be found.") from None
    except ManagedByOperator:
        raise managed_by_operator(name) from None
    await drop_unused_from_engine(ctx, removed)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def routes() -> list[Route]:
    out = []
    for prefix in ("/v1", "/t/{tenant}/v1"):
        out += [
            Route(prefix + "/load_lora_adapter", load_lora_adapter, methods=["POST"]),
            Route(prefix + "/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
        ]
    return out
