"""SGLang's runtime LoRA endpoints, ``POST /load_lora_adapter`` and ``POST /unload_lora_adapter``
(and under ``/t/{tenant}``), served by the same machinery as vLLM's (runtime_lora_routes.py: the
tenant's own adapters, paths only under ``--lora-path-root``, operator adapters left alone) and
only where that is on (``--allow-runtime-lora-updating``).

The bodies are SGLang's (``LoadLoRAAdapterReqInput``: ``lora_name``, ``lora_path``, ``pinned``;
``UnloadLoRAAdapterReqInput``: ``lora_name``); ``pinned`` keeps an adapter resident in SGLang and
changes no output, so it is taken and has no effect here. SGLang has no load in place: a name
already loaded is refused. The answer is SGLang's ``LoRAUpdateOutput``: ``{"success",
"error_message", "loaded_adapters"}``, 200 on success and 400 on failure (401, 403 and 503 keep
their statuses). ``loaded_adapters`` maps each of the tenant's adapters to the ``lora_path`` a
request names its active version with (``name@N``): loraplex keeps an adapter's weights, not
the directory they came from.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loraplex.server import runtime_lora_routes
from loraplex.server.context import AppContext
from loraplex.server.errors import from_exception
from loraplex.server.limits import parse_json


async def _loaded(ctx: AppContext, tenant: str | None) -> dict[str, str]:
    if tenant is None:
        return {}
    try:
        adapters = await run_in_threadpool(ctx.registry.list_adapters, tenant)
    except Exception:  # the answer still says whether the load worked
        return {}
    return {a.name: f"{a.name}@{a.active_version}" for a in adapters if a.active_version is not None}


async def _answer(request: Request, handler) -> Response:
    ctx: AppContext = request.app.state.ctx
    tenant = None
    try:
        tenant = await ctx.tenant_auth.tenant_for(request, request.path_params.get("tenant"))
        body = parse_json(await request.body() or b"{}")  # kept on the request for the handler
        if isinstance(body, dict) and body.get("load_inplace") is not None:
            raise ValueError("`load_inplace` is vLLM's (POST /v1/load_lora_adapter); SGLang loads a new name")
        await handler(request)
    except Exception as exc:
        if isinstance(exc, ValueError) and not hasattr(exc, "message"):  # load_inplace
            status, message, headers = 400, str(exc), {}
        else:
            err = from_exception(exc)
            status = 400 if err.status in (400, 404, 409, 422) else err.status  # SGLang's failure
            message, headers = err.message, err.headers
        return JSONResponse({"success": False, "error_message": message,
                             "loaded_adapters": await _loaded(ctx, tenant)}, status_code=status, headers=headers)
    return JSONResponse({"success": True, "error_message": None, "loaded_adapters": await _loaded(ctx, tenant)})


async def load_lora_adapter(request: Request) -> Response:
    return await _answer(request, runtime_lora_routes.load_lora_adapter)


async def unload_lora_adapter(request: Request) -> Response:
    return await _answer(request, runtime_lora_routes.unload_lora_adapter)


def routes() -> list[Route]:
    out = []
    for prefix in ("", "/t/{tenant}"):
        out += [Route(prefix + "/load_lora_adapter", load_lora_adapter, methods=["POST"]),
                Route(prefix + "/unload_lora_adapter", unload_lora_adapter, methods=["POST"])]
    return out
