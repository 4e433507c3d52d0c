"""LoRAX's native REST API (TGI's, with LoRAX's adapter fields), so ``lorax-client`` and plain-HTTP
clients of LoRAX or TGI work unchanged.

Routes, where the key decides the tenant and under ``/t/{tenant}`` (the base URL to give
``lorax.Client``): ``POST /generate`` (``{"generated_text", "details"?}``), ``POST
/generate_stream`` (server-sent events, one per token: ``{"token": {"id", "text", "logprob",
"special"}, "generated_text": null, "details": null}``, the last one with the whole text and, if
asked, the details; no ``[DONE]``) and ``POST /`` (LoRAX's compat route, which lorax-client
calls: the body's ``stream`` picks one of the two; unstreamed answers come as a one-element list).

Requests go through the same machinery as the OpenAI routes (generation.py): tenant
authentication, adapter resolution (``adapter_id`` = an adapter name or ``name@N`` of the
caller's tenant), limits, admission, metrics, the access log (``"endpoint": "generate"``) and
disconnect handling. What the parameters mean: tgi_protocol.py.

Errors use LoRAX's shape ``{"error": str, "error_type": str}``: bad input is 422
``validation`` (as LoRAX), 401 ``authentication``, an unknown adapter 404 ``not_found``, too many
requests of a tenant 429 ``overloaded`` (with Retry-After), draining 503 ``unavailable``, a
generation cut short 500 ``incomplete_generation``. A stream whose headers are out reports an
error as one last event of the same shape, as LoRAX does.
"""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loraplex.server.admission import Admission, admit
from loraplex.server.context import AppContext
from loraplex.server.errors import CLIENT_CLOSED, APIError, clipped, from_exception
from loraplex.server.generation import RequestRun, Target, tokenize_prompts
from loraplex.server.merged_adapters import resolve_merged_target
from loraplex.server.protocol import GenerationRequest
from loraplex.server.request_checks import prepare
from loraplex.server.request_ids import request_ids
from loraplex.server.shapes import ResponseShaper
from loraplex.server.streaming import ClientDisconnected, SSEResponse, run_unless_disconnected, sse_event
from loraplex.server.tgi_protocol import TGIRequest, parse_generate_request

ENDPOINT = "generate"  # the access log's and refusal log's endpoint name


def _incomplete() -> APIError:
    return APIError(500, "Incomplete generation", type="server_error", code="incomplete_generation")


def error_type(err: APIError) -> str:
    if err.code == "incomplete_generation":
        return "incomplete_generation"
    if err.status in (400, 413, 422):
        return "validation"
    if err.status in (401, 403):
        return "authentication"
    if err.status == 404:
        return "not_found"
    if err.status in (409, 429):
        return "overloaded"
    if err.status == 503:
        return "unavailable"
    return "generation"


# the OpenAI-side names some shared checks give, in LoRAX's words
PARAM_NAMES = {"prompt": "inputs", "max_tokens": "max_new_tokens", "model": "adapter_id"}


def error_body(err: APIError) -> dict:
    """LoRAX's error object; its message names the field at fault (LoRAX's has no ``param``)."""
    message = err.message
    name = PARAM_NAMES.get(err.param, err.param)
    if name and f"`{name}`" not in message:
        message = f"`{name}`: {message}"
    return {"error": message, "error_type": error_type(err)}


def http_status(err: APIError) -> int:
    return 422 if err.status == 400 else err.status  # LoRAX answers bad input with 422


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=http_status(err), headers=err.headers)


def finish_reason(reason: str, stop_reason) -> str:
    """The engine's ``"length"`` / ``"stop"`` in LoRAX's words: a stop string ended it
    (``stop_sequence``), else the end-of-sequence token (``eos_token``)."""
    if reason == "length":
        return "length"
    return "stop_sequence" if isinstance(stop_reason, str) else "eos_token"


class TokenShaper:
    """LoRAX's ``Token`` objects of one request. A token's ``text`` is the text its step added
    to the output (so non-special tokens' texts join into ``generated_text``; a character split
    over several tokens rides on the token that completes it); a special token's is its own
    text (``"</s>"``), which is no part of the output, as in LoRAX."""

    def __init__(self, tokenizer, alternatives: int):
        self.tok = tokenizer
        self.k = alternatives
        special = set(getattr(tokenizer, "all_special_ids", None) or ())
        eos = getattr(tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            special.add(eos)
        self.special = special

    def decode(self, token_id: int) -> str:
        return self.tok.decode([token_id], skip_special_tokens=False)

    def tokens(self, comp) -> list[dict]:
        ids = list(comp.token_ids)
        entries = comp.logprobs or []
        carrier = max((i for i, t in enumerate(ids) if t not in self.special), default=len(ids) - 1)
        out = []
        for i, token_id in enumerate(ids):
            special = token_id in self.special
            entry = entries[i] if i < len(entries) else {}
            text = self.decode(token_id) if special else (comp.text if i == carrier else "")
            token = {"id": token_id, "text": text, "logprob": entry.get("logprob"), "special": special}
            if self.k:
                top = ResponseShaper._top_items(entry, self.k)  # most likely first
                token["alternative_tokens"] = [{"id": t, "text": self.decode(t), "logprob": lp} for t, lp in top]
            out.append(token)
        return out

    def prefill(self, prompt_ids: list[int], computed: list | None) -> list[dict]:
        """``details.prefill``: each prompt token with its logprob (null for the first)."""
        if not computed:
            return []
        out = []
        for i, token_id in enumerate(prompt_ids):
            entry = computed[i] if i < len(computed) else None
            out.append({"id": token_id, "text": self.decode(token_id),
                        "logprob": entry.get("logprob") if isinstance(entry, dict) else None})
        return out


class _GenerateAdmission(Admission):
    """LoRAX's generate body; the prompt kept to its last ``truncate`` tokens, a context overflow
    told in LoRAX's words, refusals logged with LoRAX's statuses."""

    endpoint = ENDPOINT

    def __init__(self, stream: bool | None):
        self.stream = stream  # None: the body's ``stream`` decides
        self.treq: TGIRequest | None = None

    def parse(self, ctx: AppContext, body) -> GenerationRequest:
        self.treq, self.stream = parse_generate_request(body, ctx.served_model_name, stream=self.stream,
                                                        max_logprobs=ctx.settings.max_logprobs)
        gen = self.treq.gen
        # the sampling defaults stay LoRAX's, but an operator's max_new_tokens ceiling
        # (--generation-config FOLDER / the override) is vLLM's limit on every request
        cap = ctx.sampling_defaults.max_tokens_cap
        if cap is not None:  # an open max_new_tokens: the cap, under what the context leaves (prepare)
            gen.params.max_tokens = cap if gen.params.max_tokens is None else min(gen.params.max_tokens, cap)
        return gen

    def prompt_ids(self, ctx: AppContext, req: GenerationRequest) -> list[list[int]]:
        prompt_ids = tokenize_prompts(ctx, req)
        if self.treq.truncate is not None:  # LoRAX keeps the prompt's last `truncate` tokens
            prompt_ids = [ids[-self.treq.truncate:] for ids in prompt_ids]
        try:
            prepare(ctx, req, prompt_ids)
        except APIError as err:
            if err.code == "context_length_exceeded" and err.param == "max_tokens":
                err.message = (f"`inputs` tokens + `max_new_tokens` must be <= {ctx.max_model_len}. Given: "
                               f"{len(prompt_ids[0])} `inputs` tokens and {req.params.max_tokens} `max_new_tokens`")
            raise
        return prompt_ids

    async def resolve(self, ctx: AppContext, tenant: str, req: GenerationRequest) -> Target:
        if self.treq.merged is None:
            return await super().resolve(ctx, tenant, req)
        return await resolve_merged_target(ctx, tenant, *self.treq.merged)

    def request_id(self, req: GenerationRequest) -> str:
        return f"gen-{uuid.uuid4().hex}"

    def refused_status(self, err: APIError) -> int:
        return http_status(err)


async def _admit(request: Request, ctx: AppContext, stream: bool | None, arrival: float):
    """Authenticate, parse, resolve and admit: ``(run, request, stream)``; raises an APIError
    (in LoRAX's words) on refusal."""
    steps = _GenerateAdmission(stream)
    try:
        run = await admit(request, ctx, steps, arrival)
    except Exception as exc:
        err = from_exception(exc, request_id=request_ids(request).server)
        if err.code == "model_not_found":
            model = steps.treq.gen.model
            err.message, err.param = f"Adapter `{clipped(model)}` does not exist or you do not have access to it.", None
        raise err from None
    return run, steps.treq, steps.stream


async def _serve(request: Request, stream: bool | None, compat: bool = False) -> Response:
    arrival = time.monotonic()
    ctx: AppContext = request.app.state.ctx
    try:
        run, treq, stream = await _admit(request, ctx, stream, arrival)
    except APIError as err:
        return error_response(err)
    shaper = TokenShaper(ctx.tokenizer, treq.alternatives)
    headers = {"x-model-id": ctx.served_model_name, **run.rate_headers}
    if run.target.adapter is not None:  # a merge: its ids, joined as LoRAX names it
        headers["x-adapter-id"] = treq.adapter_id or run.target.model
    if stream:
        return SSEResponse(_events(run, treq, shaper), headers=headers, on_close=lambda: run.close(CLIENT_CLOSED))
    try:
        body = await run_unless_disconnected(request, _collect(run, treq, shaper))
    except ClientDisconnected:
        run.close(CLIENT_CLOSED)
        return Response(status_code=CLIENT_CLOSED)
    except Exception as exc:
        err = from_exception(exc, request_id=run.request_id)
        run.close(http_status(err))
        err.headers = {**run.rate_headers, **err.headers}  # as on any answer of a tenant with limits
        return error_response(err)
    except BaseException:
        run.close(CLIENT_CLOSED)
        raise
    run.close(200)
    headers.update({"x-prompt-tokens": str(run.prompt_tokens), "x-generated-tokens": str(run.completion_tokens),
                    "x-total-tokens": str(run.prompt_tokens + run.completion_tokens)})
    return JSONResponse([body] if compat else body, headers=headers)


def _prefix(treq: TGIRequest) -> str:
    return treq.inputs if treq.return_full_text else ""


async def _collect(run: RequestRun, treq: TGIRequest, shaper: TokenShaper) -> dict:
    text, tokens, finish, stop_reason = "", [], None, None
    async for _, _, comp in run.deltas():
        text += comp.text
        if treq.details:
            tokens.extend(shaper.tokens(comp))
        if comp.finish_reason is not None:
            finish, stop_reason = comp.finish_reason, comp.stop_reason
    if finish in (None, "abort"):
        raise _incomplete()
    body: dict = {"generated_text": _prefix(treq) + text}
    if treq.details:
        prefill = shaper.prefill(run.prompt_ids[0], run.prompt_logprobs.get(0)) if treq.decoder_input_details else []
        body["details"] = {
            "finish_reason": finish_reason(finish, stop_reason), "prompt_tokens": run.prompt_tokens,
            "generated_tokens": run.completion_tokens, "seed": treq.seed, "prefill": prefill, "tokens": tokens,
        }
    return body


async def _events(run: RequestRun, treq: TGIRequest, shaper: TokenShaper):
    status = CLIENT_CLOSED
    try:
        text, finished = "", False
        try:
            async for _, _, comp in run.deltas():
                text += comp.text
                tokens = shaper.tokens(comp)
                finished = comp.finish_reason is not None
                if finished and (comp.finish_reason == "abort" or not tokens):
                    raise _incomplete()
                for i, token in enumerate(tokens):
                    event = {"token": token, "generated_text": None, "details": None}
                    if finished and i == len(tokens) - 1:
                        event["generated_text"] = _prefix(treq) + text
                        if treq.details:
                            event["details"] = {
                                "finish_reason": finish_reason(comp.finish_reason, comp.stop_reason),
                                "prompt_tokens": run.prompt_tokens, "generated_tokens": run.completion_tokens,
                                "seed": treq.seed,
                            }
                    yield sse_event(event)
            if not finished:
                raise _incomplete()
        except Exception as exc:  # headers are out: report in-band, as LoRAX does
            err = from_exception(exc, request_id=run.request_id)
            status = http_status(err)
            yield sse_event(error_body(err))
            return
        status = 200
    finally:
        run.close(status)


async def generate(request: Request) -> Response:
    return await _serve(request, stream=False)


async def generate_stream(request: Request) -> Response:
    return await _serve(request, stream=True)


async def compat_generate(request: Request) -> Response:
    return await _serve(request, stream=None, compat=True)


def routes() -> list[Route]:
    out = []
    for prefix in ("", "/t/{tenant}"):
        out += [
            Route(prefix + "/generate", generate, methods=["POST"]),
            Route(prefix + "/generate_stream", generate_stream, methods=["POST"]),
            Route(prefix or "/", compat_generate, methods=["POST"]),
        ]
    return out
