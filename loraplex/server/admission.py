"""The one admission path of every generating route (OpenAI completions and chat, LoRAX
generate): authenticate, parse, resolve ``model``, tokenize and check limits, take the slots.

The steps and the order are shared; what differs per route (how the body is read, how its
prompts become token ids, the request id, the status a refusal is logged with) comes from an
``Admission``. Whatever step refuses the request, everything taken before it is given back and
the refusal gets its access line.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from loraplex.server.context import AppContext
from loraplex.server.errors import APIError, from_exception, model_not_found
from loraplex.server.generation import RequestRun, Target, log_refused, resolve_target, tokenize_prompts
from loraplex.server.limits import read_json
from loraplex.server.protocol import GenerationRequest
from loraplex.server.reasoned_constraints import set_boundary
from loraplex.server.request_checks import prepare
from loraplex.server.request_ids import RequestIds, request_ids
from loraplex.server.shapes import new_id


async def authenticate(ctx: AppContext, request: Request) -> str:
    """The caller's tenant: the key's, which must match ``/t/{tenant}`` where the path names one."""
    return await ctx.tenant_auth.tenant_for(request, request.path_params.get("tenant"))


async def check_model(ctx: AppContext, tenant: str, model: str) -> None:
    """404 ``model_not_found`` (as ``resolve_target`` answers) unless ``model`` is the base
    model or names one of the tenant's adapters (``name`` with an active version, or
    ``name@N``). A registry lookup only: no version is pinned, no file fetched or loaded, for
    routes that need the name checked but run nothing on the adapter (the tokenizer routes)."""
    if model == ctx.served_model_name:
        return
    try:
        await run_in_threadpool(ctx.registry.resolve, tenant, model)
    except Exception as exc:
        if getattr(exc, "http_status", None) in (400, 404):  # no such name, or one that could never be one
            raise model_not_found(model) from None
        raise


def release_target(ctx: AppContext, target: Target) -> None:
    """Give back the adapter version ``resolve_target`` acquired (nothing for the base model)."""
    if target.adapter is not None:
        ctx.adapters.release(target.adapter.content_hash)


class Admission:
    """One route's own admission steps; ``admit`` runs them between the shared ones."""

    endpoint = "completion"  # the access log's ``endpoint`` of a refused request

    def parse(self, ctx: AppContext, body) -> GenerationRequest:
        raise NotImplementedError

    def prompt_ids(self, ctx: AppContext, req: GenerationRequest) -> list[list[int]]:
        """Token ids per prompt, limits checked (``prepare`` may set ``max_tokens``); a
        constrained chat request gets its reasoning boundary (reasoned_constraints.py)."""
        ids = tokenize_prompts(ctx, req)
        prepare(ctx, req, ids)
        set_boundary(ctx, req, ids)  # a constraint after the reasoning, with a reasoning parser
        return ids

    async def resolve(self, ctx: AppContext, tenant: str, req: GenerationRequest) -> Target:
        """What ``req`` runs on, held until the run's ``close`` (``resolve_target``)."""
        return await resolve_target(ctx, tenant, req.model)

    def request_id(self, req: GenerationRequest) -> str:
        return new_id(req.kind)

    def refused_status(self, err: APIError) -> int:
        return err.status

    def named(self, err: APIError) -> APIError:
        """A refusal of the shared admission (the rate limits' 400 names ``max_tokens``), in
        the route's own field names."""
        return err


async def admit(request: Request, ctx: AppContext, steps: Admission, arrival: float) -> RequestRun:
    """The admitted run of an HTTP request: its key's tenant and its JSON body, then
    ``admit_body``. A refusal is raised as it came, after its access line is written."""
    tenant = None
    ids = request_ids(request)
    try:
        tenant = await authenticate(ctx, request)
        body = await read_json(request, ctx.settings.max_body_bytes)
    except Exception as exc:
        status = steps.refused_status(from_exception(exc, log_unknown=False))
        log_refused(steps.endpoint, tenant, None, status, arrival, ids)
        raise
    return await admit_body(ctx, tenant, body, steps, arrival, ids)


async def admit_body(ctx: AppContext, tenant: str, body, steps: Admission, arrival: float,
                     ids: RequestIds | None = None) -> RequestRun:
    """The admitted run of ``tenant``'s parsed JSON ``body`` (a route after authentication, or a
    line of a batch file), holding the adapter version, a drain slot and a tenant slot until its
    ``close``, under the tenant's own cap when an operator set one. A refusal is raised as it
    came (an unknown exception is left for the caller to log), after its access line is written
    and whatever was taken is given back. ``ids`` are the HTTP request's (request_ids.py): once
    admitted, the run's id is the one its response headers carry."""
    model = None
    try:
        limits = await ctx.tenant_limits.get(tenant)  # before anything is held: a failure leaks nothing
        req = steps.parse(ctx, body)
        model = req.model
        target = await steps.resolve(ctx, tenant, req)  # holds the adapter version from here
        try:
            if req.has_text:  # off the event loop, which every open stream's chunks wait for
                prompt_ids = await ctx.run_tokenizer(steps.prompt_ids, ctx, req)
            else:  # token ids: nothing to wait behind a long prompt's tokenizing for
                prompt_ids = steps.prompt_ids(ctx, req)
        except BaseException:
            release_target(ctx, target)
            raise
        client_id = ids.client if ids is not None else None
        if client_id is None:  # no X-Request-Id header: vLLM's request_id field, where the body has one
            client_id = getattr(req, "client_request_id", None)
        run = RequestRun(ctx, tenant, target, req, prompt_ids, steps.request_id(req), arrival, limits,
                         client_request_id=client_id)
        try:
            run.admit()  # on refusal (503/429/400) it has released everything
        except APIError as err:
            raise steps.named(err) from None
    except Exception as exc:
        status = steps.refused_status(from_exception(exc, log_unknown=False))
        log_refused(steps.endpoint, tenant, model, status, arrival, ids)
        raise
    if ids is not None:
        ids.server = run.request_id  # the server's id of the response, in its header and its access line
        ids.client = client_id  # a body's request_id is echoed as X-Request-Id is
    return run
