"""SGLang's native API, where the key decides the tenant and under ``/t/{tenant}``, so clients
and scripts written for ``python -m sglang.launch_server`` work unchanged.

``POST /generate`` is also LoRAX's path (tgi_routes.py): the body tells them apart. SGLang's has
``text`` or ``input_ids`` (and ``sampling_params``), LoRAX's has ``inputs`` (and
``parameters``); an object with both kinds of field, or neither, is a 400 naming them (a body
that is not a JSON object gets LoRAX's answer, as before).

- ``POST /generate`` (sglang_protocol.py): one output object, or a list for a batch or ``n`` >
  1 (prompt by prompt, n each), shaped by sglang_shapes.py. ``stream: true``: server-sent
  events ``data: {...}`` with the cumulative text of one output each (``"index"`` says which,
  for a batch), then ``data: [DONE]``, as SGLang streams.
- ``GET /get_model_info``, ``GET /get_server_info`` (the settings that mean the same in
  loraplex, under SGLang's names; nothing made up), ``GET /health_generate`` (200 once a
  one-token generation of the base model comes back, or while requests run; 503 otherwise).
- ``POST /flush_cache`` (admin key): forgets the prefix cache when no request is running or
  waiting, else leaves it and answers 400, as SGLang does.

Errors have SGLang's shape ``{"error": {"message": str}}``. SGLang answers bad input and an
unknown ``lora_path`` with 400; authentication (401), tenant limits (429), draining (503) keep
their statuses. A stream whose headers are out ends with ``data: {"error": ...}`` and ``[DONE]``.
``POST /generate`` checks the key before it reads the body, so its 401 cannot know the API yet:
it has LoRAX's shape, a string ``error`` as SGLang's own ``--api-key`` check answers.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

import loraplex
from loraplex.sampling_params import SamplingParams
from loraplex.server import sglang_abort, tgi_routes
from loraplex.server.admission import Admission, admit_body, authenticate, check_model
from loraplex.server.context import AppContext
from loraplex.server.errors import CLIENT_CLOSED, APIError, bad_request, from_exception
from loraplex.server.generation import RequestRun, log_refused, tokenize_prompts
from loraplex.server.protocol import GenerationRequest
from loraplex.server.request_ids import request_ids
from loraplex.server.sglang_protocol import SGLangRequest, parse_sglang_request
from loraplex.server.sglang_shapes import OutputState, SGLangShaper
from loraplex.server.streaming import ClientDisconnected, SSEResponse, run_unless_disconnected

ENDPOINT = "sglang_generate"  # the access log's endpoint (GenerationRequest.kind too)
SGLANG_FIELDS = ("text", "input_ids", "sampling_params")
LORAX_FIELDS = ("inputs", "parameters")
HEALTH_TIMEOUT_SECONDS = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT default


def error_response(err: APIError) -> JSONResponse:
    status = 400 if err.code == "model_not_found" or err.status == 422 else err.status
    return JSONResponse({"error": {"message": err.message}}, status_code=status, headers=err.headers)


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class _GroupAdmission(Admission):
    """Admits one group of an already parsed request."""

    endpoint = ENDPOINT

    def __init__(self, gen: GenerationRequest, logprob_start_len: int = -1):
        self.gen = gen
        self.logprob_start_len = logprob_start_len  # -1 unless the request returns logprobs

    def parse(self, ctx: AppContext, body) -> GenerationRequest:
        return self.gen

    def prompt_ids(self, ctx: AppContext, req: GenerationRequest) -> list[list[int]]:
        try:
            ids = super().prompt_ids(ctx, req)
        except APIError as err:
            if err.code == "context_length_exceeded" and err.param == "max_tokens":
                prompt = max(len(ids) for ids in tokenize_prompts(ctx, req))
                err.message = (f"Requested token count exceeds the model's maximum context length of "
                               f"{ctx.max_model_len} tokens. You requested a total of "
                               f"{prompt + req.params.max_tokens} tokens: {prompt} tokens from the input and "
                               f"{req.params.max_tokens} tokens for the completion (max_new_tokens).")
            elif err.param == "prompt" and "token ids" in err.message:
                err.message = err.message.replace("prompt token ids", "`input_ids`")
            raise
        shortest = min(len(p) for p in ids)
        if self.logprob_start_len > shortest:  # SGLang's scheduler refuses it so
            raise bad_request(f"logprob_start_len={self.logprob_start_len} is higher than the number of input "
                              f"tokens ({shortest}). Please use a smaller logprob_start_len.",
                              param="logprob_start_len")
        return ids

    def request_id(self, req: GenerationRequest) -> str:
        return f"sglang-{uuid.uuid4().hex}"


def _unknown_adapter(model: str) -> APIError:
    return APIError(400, f"The following requested LoRA adapters are not loaded: {model}",
                    code="model_not_found")


async def _admit_all(request: Request, ctx: AppContext, body: dict, arrival: float):
    """``(request, runs)``: parsed, every adapter checked before anything is taken, then each
    group admitted; a refusal gives back what earlier groups took."""
    ids = request_ids(request)
    tenant = None
    try:
        tenant = await authenticate(ctx, request)
        sreq = parse_sglang_request(body, ctx.served_model_name, ctx.settings.max_logprobs,
                                    ctx.settings.max_n)
        for group in sreq.groups:
            try:
                await check_model(ctx, tenant, group.gen.model)
            except APIError as err:
                raise _unknown_adapter(group.gen.model) if err.code == "model_not_found" else err from None
    except Exception as exc:
        log_refused(ENDPOINT, tenant, None, from_exception(exc, log_unknown=False).status, arrival, ids)
        raise
    runs: list[RequestRun] = []
    try:
        for group in sreq.groups:
            start = sreq.logprob_start_len if sreq.return_logprob else -1
            runs.append(await admit_body(ctx, tenant, body, _GroupAdmission(group.gen, start), arrival, ids))
    except Exception as exc:
        err = from_exception(exc, log_unknown=False)
        for run in runs:  # nothing of this request ran
            run.withdraw(err.status)
        raise
    return sreq, runs


class _Outputs:
    """Every output of a request, fed by its groups' runs."""

    def __init__(self, ctx: AppContext, sreq: SGLangRequest, runs: list[RequestRun], arrival: float):
        self.sreq, self.runs = sreq, runs
        n = sreq.n
        self.states = [OutputState(rid=sreq.rids[i], prompt_index=i // n, score_only=sreq.max_new_tokens[i // n] == 0)
                       for i in range(sreq.batch_size * n)]
        self.prompt_ids: dict[int, list[int]] = {}
        for group, run in zip(sreq.groups, runs):
            for p_idx, index in enumerate(group.indices):
                self.prompt_ids[index] = run.prompt_ids[p_idx]
        max_new = dict(enumerate(sreq.max_new_tokens))  # as asked: 0 for prompt scoring, not the step run
        self.shaper = SGLangShaper(ctx.tokenizer, return_logprob=sreq.return_logprob, start=sreq.logprob_start_len,
                                   top=sreq.top_logprobs_num, with_text=sreq.return_text_in_logprobs,
                                   max_new_tokens=max_new, arrival=arrival)

    def _run_of(self, index: int) -> tuple[RequestRun, int] | None:
        """The run of prompt ``index`` and the prompt's place in it."""
        for group, run in zip(self.sreq.groups, self.runs):
            if index in group.indices:
                return run, group.indices.index(index)
        return None

    def _computed(self, index: int):
        found = self._run_of(index)
        return found[0].prompt_logprobs.get(found[1]) if found else None

    def _cached(self, index: int) -> int:
        found = self._run_of(index)
        return (found[0].cached_per_prompt[found[1]] or 0) if found else 0

    def shaped(self, out_index: int) -> dict:
        state = self.states[out_index]
        p_idx = state.prompt_index
        body = self.shaper.output(state, self.prompt_ids[p_idx], self._computed(p_idx), self._cached(p_idx))
        if not self.sreq.is_single and self.sreq.stream:
            body["index"] = out_index
        return body

    async def deltas(self):
        """Yields the output index each engine delta grew, from all groups at once."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(group, run) -> None:
            try:
                async for p_idx, _, comp in run.deltas():
                    index = group.indices[p_idx] * self.sreq.n + comp.index
                    self.states[index].add(comp)
                    await queue.put(index)
                await queue.put(done)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                await queue.put(exc)

        tasks = [asyncio.ensure_future(pump(g, r)) for g, r in zip(self.sreq.groups, self.runs)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def incomplete(self) -> bool:
        return any(s.finish in (None, "abort") for s in self.states)

    def close(self, status: int) -> None:
        for run in self.runs:
            run.close(status)


def _incomplete() -> APIError:
    return APIError(500, "The request was aborted before it finished.", code="incomplete_generation")


async def _collect(outputs: _Outputs):
    async for _ in outputs.deltas():
        pass
    if outputs.incomplete():
        raise _incomplete()
    bodies = [outputs.shaped(i) for i in range(len(outputs.states))]
    return bodies[0] if outputs.sreq.is_single else bodies


async def _events(outputs: _Outputs):
    status = CLIENT_CLOSED
    try:
        try:
            async for index in outputs.deltas():
                state = outputs.states[index]
                if state.score_only and state.finish is None:
                    continue  # prompt scoring: nothing to show until it is done
                yield _sse(outputs.shaped(index))
            if outputs.incomplete():
                raise _incomplete()
            status = 200
        except Exception as exc:  # headers are out: SGLang reports it in-band
            err = from_exception(exc)
            status = err.status
            yield _sse({"error": {"message": err.message}})
        yield b"data: [DONE]\n\n"
    finally:
        outputs.close(status)


async def _serve_sglang(request: Request, ctx: AppContext, body: dict, arrival: float) -> Response:
    try:
        sreq, runs = await _admit_all(request, ctx, body, arrival)
    except Exception as exc:
        return error_response(from_exception(exc, request_id=request_ids(request).server))
    outputs = _Outputs(ctx, sreq, runs, arrival)
    # the engine requests are submitted before the call can be found by /abort_request: its
    # outputs are read ticks later (the response's body, each group's pump), and an abort of an
    # engine request not yet submitted was dropped
    for run in runs:
        run.start()
    ctx.sglang_calls.track(runs[0].tenant, outputs)  # for /abort_request (sglang_abort.py)
    headers = {k: v for run in runs for k, v in run.rate_headers.items()}
    if sreq.stream:
        return SSEResponse(_events(outputs), headers=headers, on_close=lambda: outputs.close(CLIENT_CLOSED))
    try:
        result = await run_unless_disconnected(request, _collect(outputs))
    except ClientDisconnected:
        outputs.close(CLIENT_CLOSED)
        return Response(status_code=CLIENT_CLOSED)
    except Exception as exc:
        err = from_exception(exc, request_id=request_ids(request).server)
        outputs.close(err.status)
        return error_response(err)
    except BaseException:
        outputs.close(CLIENT_CLOSED)
        raise
    outputs.close(200)
    return JSONResponse(result, headers=headers)


async def generate(request: Request) -> Response:
    """``POST /generate``: SGLang's body here, LoRAX's (and a body that is no JSON object,
    which LoRAX answers as it always has) to tgi_routes. The key is checked before the body is
    read; its refusal has LoRAX's shape."""
    arrival = time.monotonic()
    ctx: AppContext = request.app.state.ctx
    try:  # before the body: a caller without a key gets no read nor parse of up to --max-body-bytes
        await authenticate(ctx, request)
    except Exception as exc:
        # which API the body speaks is not known yet: LoRAX's error shape, which is also the one
        # SGLang's --api-key check answers (a string `error`)
        err = from_exception(exc)
        log_refused(ENDPOINT, None, None, tgi_routes.http_status(err), arrival, request_ids(request))
        return tgi_routes.error_response(err)
    try:
        raw = await request.body()  # kept on the request: LoRAX's handler reads it again
    except Exception as exc:
        return error_response(from_exception(exc))
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested past the parser's recursion
        body = None
    if not isinstance(body, dict):
        return await tgi_routes.generate(request)
    sglang = [f for f in SGLANG_FIELDS if f in body]
    lorax = [f for f in LORAX_FIELDS if f in body]
    if lorax and not sglang:
        return await tgi_routes.generate(request)
    if sglang and not lorax:
        return await _serve_sglang(request, ctx, body, arrival)
    message = ("The body mixes SGLang's fields (`text`/`input_ids`, `sampling_params`) with LoRAX's "
               f"(`inputs`, `parameters`): {', '.join(sglang + lorax)}; send one kind."
               if sglang else "Give SGLang's `text` or `input_ids` (with `sampling_params`), or LoRAX's "
               "`inputs` (with `parameters`).")
    log_refused(ENDPOINT, None, None, 400, arrival, request_ids(request))
    return error_response(bad_request(message))


async def _tenant_or_error(request: Request, ctx: AppContext) -> Response | None:
    try:
        await authenticate(ctx, request)
    except Exception as exc:
        return error_response(from_exception(exc))
    return None


async def get_model_info(request: Request) -> Response:
    ctx: AppContext = request.app.state.ctx
    refused = await _tenant_or_error(request, ctx)
    if refused is not None:
        return refused
    s = ctx.settings
    return JSONResponse({"model_path": s.model, "tokenizer_path": s.model, "is_generation": True,
                         "preferred_sampling_params": None, "weight_version": "default"})


def _chunk_size(ctx: AppContext) -> int:
    """The prefill chunk (the step's token budget) the engine runs with; -1 without chunking."""
    config = getattr(ctx.engine, "config", None)  # the engine's: its budget is final there
    chunked = getattr(config, "enable_chunked_prefill", ctx.settings.enable_chunked_prefill)
    budget = getattr(config, "max_num_batched_tokens", None) or ctx.settings.max_num_batched_tokens
    return budget if chunked and budget else -1


def server_info(ctx: AppContext) -> dict:
    """The SGLang server arguments that mean the same in loraplex, and their values."""
    s = ctx.settings
    return {
        "model_path": s.model, "served_model_name": ctx.served_model_name, "dtype": s.dtype,
        "host": s.host, "port": s.port, "random_seed": s.seed, "context_length": ctx.max_model_len,
        "max_running_requests": s.max_num_seqs, "chunked_prefill_size": _chunk_size(ctx),
        "disable_radix_cache": not s.enable_prefix_caching, "enable_lora": True,
        "max_loras_per_batch": s.max_loras, "max_lora_rank": s.max_lora_rank,
        "kv_cache_dtype": s.kv_cache_dtype, "quantization": s.quantization,
        "version": loraplex.__version__,
    }


async def get_server_info(request: Request) -> Response:
    ctx: AppContext = request.app.state.ctx
    refused = await _tenant_or_error(request, ctx)
    return refused or JSONResponse(server_info(ctx))


async def health_generate(request: Request) -> Response:
    """SGLang's deep health check: a one-token greedy generation of the base model, skipped while
    the engine has requests (they show it works)."""
    ctx: AppContext = request.app.state.ctx
    if not ctx.lifecycle.started or ctx.lifecycle.draining:
        return Response(status_code=503)
    stats = ctx.engine_stats()
    if stats.get("num_requests_running") or stats.get("num_requests_waiting"):
        return Response(status_code=200)
    rid = f"health-{uuid.uuid4().hex}"
    bos = getattr(ctx.tokenizer, "bos_token_id", None)
    prompt = [bos if isinstance(bos, int) else 0]

    async def one_token() -> bool:
        async for out in ctx.engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0), request_id=rid):
            if out.outputs and out.outputs[0].token_ids:
                return True
        return False

    try:
        ok = await asyncio.wait_for(one_token(), HEALTH_TIMEOUT_SECONDS)
    except Exception:
        ok = False
    finally:
        ctx.engine.abort(rid)
    return Response(status_code=200 if ok else 503)


async def flush_cache(request: Request) -> Response:
    ctx: AppContext = request.app.state.ctx
    try:
        await ctx.admin_auth.require(request)
    except Exception as exc:
        return error_response(from_exception(exc))
    flush = getattr(ctx.engine, "flush_prefix_cache", None)
    done = bool(flush is not None and await flush())
    return PlainTextResponse(
        "Cache flushed.\n" if done else
        "Cache not flushed: requests are running or waiting (it is flushed only when the server is idle).\n",
        status_code=200 if done else 400)


def routes() -> list[Route]:
    out = []
    for prefix in ("", "/t/{tenant}"):
        out += [
            Route(prefix + "/generate", generate, methods=["POST", "PUT"]),
            Route(prefix + "/get_model_info", get_model_info, methods=["GET"]),
            Route(prefix + "/get_server_info", get_server_info, methods=["GET"]),
        ]
    out += [Route("/health_generate", health_generate, methods=["GET"]),
            Route("/flush_cache", flush_cache, methods=["GET", "POST"])]
    return out + sglang_abort.routes()
