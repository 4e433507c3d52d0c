"""Admin usage API (admin bearer key), for billing and chargeback:

* ``GET /admin/v1/usage`` with optional ``tenant``, ``adapter``, ``start``, ``end`` (ISO 8601 on
  the hour, UTC when no offset; ``start`` inclusive, ``end`` exclusive) and ``group_by`` (any of
  ``tenant``, ``adapter``, ``hour``, ``day``, comma-separated or repeated; hour or day, not both);
* ``GET /admin/v1/tenants/{tenant}/usage``: the same for one tenant (404 for a tenant that
  neither exists nor has usage: usage outlives what it counts, a typo should not look empty).

Answers ``{"object": "usage", "start", "end", "group_by", "data": [rows], "totals"}``; each row
holds its group keys (``adapter`` null: the base model) and ``requests``, ``prompt_tokens``,
``completion_tokens``, ``total_tokens`` of answered requests, and ``failed_requests``,
``failed_prompt_tokens``, ``failed_completion_tokens`` of admitted ones that ended otherwise.
This replica's unwritten sums are flushed first, so its own requests are in the answer; other
replicas' land within their ``usage_flush_seconds``. Bad parameters are a 400 naming the param.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loraplex.registry.errors import InvalidName
from loraplex.registry.names import validate_adapter_name, validate_tenant_name
from loraplex.registry.usage import parse_hour
from loraplex.server.admin_routes import _admin, _not_found
from loraplex.server.context import AppContext
from loraplex.server.errors import bad_request

QUERY_PARAMS = ("tenant", "adapter", "start", "end", "group_by")


def _filters(request: Request) -> dict:
    """The query's filters and grouping, checked (a 400 naming the param)."""
    query = request.query_params
    for name in QUERY_PARAMS:
        if name != "group_by" and len(query.getlist(name)) > 1:
            raise bad_request(f"`{name}` is given more than once", param=name)
    filters: dict = {"group_by": query.getlist("group_by")}
    for name in ("start", "end"):
        if name in query:
            filters[name] = parse_hour(query[name], name)  # InvalidSetting: a 400 naming it
    for name in ("tenant", "adapter"):
        if name in query:
            filters[name] = _name(query[name], name)
    return filters


def _name(value: str, param: str) -> str:
    """A tenant or adapter name, or a 400 naming ``param`` for one that could never be a name."""
    try:
        return (validate_tenant_name if param == "tenant" else validate_adapter_name)(value)
    except InvalidName as exc:
        raise bad_request(str(exc), param=param, code="invalid_name") from None


async def _report(ctx: AppContext, filters: dict) -> dict:
    if ctx.usage is not None:
        await run_in_threadpool(ctx.usage.flush)  # this replica's own requests are in the answer
    report = await run_in_threadpool(lambda: ctx.registry.usage_report(**filters))
    return report.to_dict()


async def usage(request: Request) -> Response:
    ctx = await _admin(request)
    return JSONResponse(await _report(ctx, _filters(request)))


async def tenant_usage(request: Request) -> Response:
    ctx = await _admin(request)
    tenant = request.path_params["tenant"]
    if "tenant" in request.query_params:
        raise bad_request("the tenant is in the path; leave out the `tenant` query parameter", param="tenant")
    body = await _report(ctx, {**_filters(request), "tenant": _name(tenant, "tenant")})
    if not body["data"] and await run_in_threadpool(ctx.registry.get_tenant, tenant) is None:
        raise _not_found(f"tenant {tenant!r}")
    return JSONResponse(body)


def routes() -> list[Route]:
    return [
        Route("/admin/v1/usage", usage, methods=["GET"]),
        Route("/admin/v1/tenants/{tenant}/usage", tenant_usage, methods=["GET"]),
    ]
