"""SGLang's ``POST /abort_request`` (sgl-project/sglang http_server.py ``abort_request``, body
io_struct.py ``AbortReq``: ``{"rid": str = "", "abort_all": bool = False}``), which RL rollout
frameworks (slime, verl) call to stop generations they no longer want.

``rid`` is an output's ``meta_info.id`` (the ``rid`` a ``/generate`` call gave, or the one the
server made); ``abort_all`` aborts every call of the caller's tenant, never another tenant's (an
other tenant's ``rid`` is as unknown as one never given). Each aborted output ends as SGLang ends
it: a finished output whose ``finish_reason`` is ``{"type": "abort", "message": "Abort in
waiting queue"}`` when it had no token yet, else ``{"type": "abort", "message": "Aborted",
"status_code": null, "err_type": null}``, the stream then ``[DONE]``; the engine request stops
and its KV blocks and adapter hold go back. The answer is SGLang's: 200 with an empty body,
whether or not the ``rid`` named a running request. A ``rid`` of one sample of an ``n`` > 1 call
aborts its siblings too: loraplex runs a prompt's samples as one engine request.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loraplex.server.admission import authenticate
from loraplex.server.context import AppContext
from loraplex.server.errors import APIError, bad_request, from_exception
from loraplex.server.limits import parse_json, read_body


def _parse(body) -> tuple[str, bool]:
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object.")
    rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
    if not isinstance(rid, str):
        raise bad_request("`rid` must be a string", param="rid")
    if not isinstance(abort_all, bool):
        raise bad_request("`abort_all` must be a boolean", param="abort_all")
    return rid, abort_all


def abort_outputs(engine, outputs, rid: str | None) -> int:
    """Abort the unfinished outputs of one call whose ``rid`` is ``rid`` (all of them for None):
    each is marked first (so the engine's closing ``abort`` delta is read as asked for), then its
    engine request is aborted. Returns how many outputs were aborted."""
    prompts = {s.prompt_index for s in outputs.states if s.finish is None and (rid is None or s.rid == rid)}
    aborted = 0
    for state in outputs.states:
        if state.prompt_index in prompts and state.finish is None:
            state.abort_requested()
            aborted += 1
    for group, run in zip(outputs.sreq.groups, outputs.runs):
        for p_idx, prompt in enumerate(group.indices):
            if prompt in prompts:
                engine.abort(run.engine_ids[p_idx])
    return aborted


async def abort_request(request: Request) -> Response:
    ctx: AppContext = request.app.state.ctx
    try:
        tenant = await authenticate(ctx, request)
        rid, abort_all = _parse(parse_json(await read_body(request, ctx.settings.max_body_bytes) or b"{}"))
    except Exception as exc:
        err: APIError = from_exception(exc)
        return JSONResponse({"error": {"message": err.message}}, status_code=err.status, headers=err.headers)
    if abort_all or rid:
        for outputs in ctx.sglang_calls.live(tenant):
            abort_outputs(ctx.engine, outputs, None if abort_all else rid)
    return Response(status_code=200)


def routes() -> list[Route]:
    return [Route(prefix + "/abort_request", abort_request, methods=["POST"]) for prefix in ("", "/t/{tenant}")]
