"""``DELETE /admin/v1/tenants/{tenant}`` (admin bearer key): offboard a tenant.

In one registry transaction (``RegistryService.delete_tenant``) every key of the tenant is
revoked, every adapter and version deleted, and the tenant tombstoned: its name no longer
authenticates, lists or serves, and is never given to a new tenant (usage stays under the name
for billing). Then, as ``DELETE .../adapters/{name}`` does: weights no live version of any
tenant uses leave this replica's device slots and host cache; blobs no live version uses are
deleted once the last request running on them ends (shared blobs stay). Requests already
running finish normally.

This replica forgets its cached keys at once, so the tenant's next request here gets 401;
other replicas within ``registry_poll_seconds`` (their key cache), and drop the weights
from their engines within that interval too (replica_deletes.py). Answers ``{"name", "deleted": true, "api_keys_revoked",
"adapters_deleted", "versions_deleted", "adapters": [names]}``; 404 for an unknown (or already
deleted) tenant, 400 for a malformed name, and nothing changes then.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loraplex.server.admin_routes import ACTOR, _admin, drop_unused_from_engine


async def delete_tenant(request: Request) -> Response:
    ctx = await _admin(request)
    name = request.path_params["tenant"]
    # the adapter manager also drops unused blobs (after in-flight requests); a bare registry not
    delete = getattr(ctx.adapters, "delete_tenant", None) or ctx.registry.delete_tenant
    deletion = await run_in_threadpool(delete, name, ACTOR)
    ctx.tenant_auth.forget_all()  # the revoked keys: effective at once on this replica
    ctx.tenant_limits.forget(name)
    await drop_unused_from_engine(ctx, deletion.versions)
    return JSONResponse({"name": name, "deleted": True, **deletion.counts(), "adapters": deletion.adapters})


def routes() -> list[Route]:
    return [Route("/admin/v1/tenants/{tenant}", delete_tenant, methods=["DELETE"])]
