"""LoRAX's (TGI's) ``GET /info`` and ``POST /tokenize``, next to its generate routes
(tgi_routes.py), with the same tenant authentication and LoRAX's error shape.

``/info`` answers LoRAX's ``Info`` (predibase/lorax ``router/src/lib.rs``) with the fields that
mean something in loraplex, read from the running server: ``model_id`` (the served name),
``model_dtype`` and ``model_device_type`` (as torch names them), ``max_input_length`` (also
under TGI's newer name ``max_input_tokens``) and ``max_total_tokens`` (the prompt limit and the
context length), ``max_concurrent_requests`` (the caller's tenant's: its own cap when an operator
set one, else the server's per-tenant default; loraplex's limit is a tenant's, not the server's),
``max_best_of`` 1, ``max_stop_sequences`` null (no limit), ``version`` (loraplex's).

Under ``--tenant-limits-scope cluster`` the live replicas divide a tenant's own cap
(tenant_limits.py). ``max_concurrent_requests`` stays the cap as configured, as the
``x-ratelimit-limit-*`` headers give the tenant's whole rate limits (rate_limits.py): a client
behind the balancer talks to the whole deployment. ``replica_max_concurrent_requests``, a field
of loraplex's own, is what the replica that answered admits: its share (the whole cap under the
replica scope, and the server's default, which is per replica, in both).
LoRAX's router-scheduler knobs (``waiting_served_ratio``, ``max_batch_total_tokens``,
``max_waiting_tokens``, ``validation_workers``, ``eager_prefill``) have no counterpart and are
left out rather than made up.

``/tokenize`` takes LoRAX's ``{"inputs": str, "add_special_tokens"?: true}`` (TGI's
``{"inputs", "parameters"}`` too: of the parameters only ``truncate`` changes the tokens, keeping
the last N as TGI does; the others are ignored) and answers LoRAX's list of ``{"id", "text",
"start", "stop"}``: ``text`` is the vocabulary entry (LoRAX's ``id_to_token``), ``start``/``stop``
character offsets into ``inputs`` (``inputs[start:stop]`` is the text the token covers; a
special token the tokenizer adds covers nothing).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import loraplex
from loraplex.server.admission import authenticate
from loraplex.server.body_fields import read_bool, read_int
from loraplex.server.context import AppContext
from loraplex.server.errors import bad_request, from_exception
from loraplex.server.limits import max_prompt_len
from loraplex.server.request_ids import request_ids
from loraplex.server.tenant_limits import DEFAULT_LIMITS, TenantLimits
from loraplex.server.tgi_protocol import parameters
from loraplex.server.tgi_routes import error_response


def _runner(ctx: AppContext):
    """The model runner behind the async engine, where there is one (its dtype and device)."""
    return getattr(getattr(ctx.engine, "engine", None), "runner", None)


def info_body(ctx: AppContext, limits: TenantLimits = DEFAULT_LIMITS, replicas: int = 1) -> dict:
    """LoRAX's ``Info`` for a caller whose tenant has ``limits`` (its own concurrency cap, when
    an operator set one), ``replicas`` live replicas sharing it (module docstring)."""
    runner = _runner(ctx)
    dtype = getattr(runner, "dtype", None)
    device = getattr(runner, "device", None)
    s = ctx.settings
    max_input = max_prompt_len(ctx.max_model_len, s.max_prompt_tokens)
    return {
        "model_id": ctx.served_model_name,
        "model_sha": None,
        "model_dtype": str(dtype) if dtype is not None else s.dtype,
        "model_device_type": getattr(device, "type", None) or str(device or s.device),
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": limits.max_concurrent_requests or s.max_concurrent_requests_per_tenant,
        "replica_max_concurrent_requests": limits.concurrency_cap(replicas) or s.max_concurrent_requests_per_tenant,
        "max_best_of": 1,
        "max_stop_sequences": None,
        "max_input_length": max_input,
        "max_input_tokens": max_input,
        "max_total_tokens": ctx.max_model_len,
        "version": loraplex.__version__,
        "sha": None,
        "docker_label": None,
        "request_logger_url": None,
    }


async def info(request: Request) -> Response:
    ctx: AppContext = request.app.state.ctx
    try:
        tenant = await authenticate(ctx, request)
        limits = await ctx.tenant_limits.get(tenant)
    except Exception as exc:
        return error_response(from_exception(exc, request_id=request_ids(request).server))
    return JSONResponse(info_body(ctx, limits, ctx.live_replicas))


def parse_tokenize_request(body: dict) -> tuple[str, bool, int | None]:
    """``(inputs, add_special_tokens, truncate)``."""
    inputs = body.get("inputs")
    if not isinstance(inputs, str):
        raise bad_request("`inputs` must be a string", param="inputs")
    add_special = read_bool(body, "add_special_tokens", True)
    truncate = read_int(parameters(body), "truncate", None)
    if truncate is not None and truncate < 1:
        raise bad_request("`truncate` must be strictly positive", param="truncate")
    return inputs, add_special, truncate


def simple_tokens(tokenizer, inputs: str, add_special: bool, truncate: int | None) -> list[dict]:
    enc = tokenizer(inputs, add_special_tokens=add_special, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    if truncate is not None:
        ids, offsets = ids[-truncate:], offsets[-truncate:]
    pieces = tokenizer.convert_ids_to_tokens(ids)
    return [{"id": i, "text": piece, "start": start, "stop": stop}
            for i, piece, (start, stop) in zip(ids, pieces, offsets)]


async def tokenize(request: Request, ctx: AppContext, body: dict) -> Response:
    """LoRAX's ``POST /tokenize`` (tokenizer_routes.py sends it bodies with ``inputs``)."""
    try:
        await authenticate(ctx, request)
        inputs, add_special, truncate = parse_tokenize_request(body)
        try:
            tokens = await ctx.run_tokenizer(simple_tokens, ctx.tokenizer, inputs, add_special, truncate)
        except NotImplementedError:  # a slow (Python) tokenizer has no offsets
            return JSONResponse({"error": "No fast tokenizer or tokenizer.json for this model",
                                 "error_type": "no fast tokenizer"}, status_code=404)
    except Exception as exc:
        return error_response(from_exception(exc, request_id=request_ids(request).server))
    return JSONResponse(tokens)


def routes() -> list[Route]:
    return [Route(prefix + "/info", info, methods=["GET"]) for prefix in ("", "/t/{tenant}")]
