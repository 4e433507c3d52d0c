"""Tenant routes, OpenAI-compatible: ``/t/{tenant}/v1/...`` and ``/v1/...`` (the key's tenant)."""

from __future__ import annotations

import time

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loraplex.server import chat_output, reasoned_constraints, tool_calls
from loraplex.server.admission import Admission, admit
from loraplex.server.context import AppContext
from loraplex.server.errors import CLIENT_CLOSED, from_exception, model_not_found
from loraplex.server.generation import RequestRun
from loraplex.server.protocol import GenerationRequest, parse_chat_request, parse_completion_request, with_default_model
from loraplex.server.request_defaults import apply_server_defaults
from loraplex.server.shapes import ResponseShaper, TextOffsets, client_answer_id
from loraplex.server.streaming import DONE, ClientDisconnected, SSEResponse, run_unless_disconnected, sse_event
from loraplex.server.token_ids_output import StreamTokenIds, add_to_answer


def _ctx(request: Request) -> AppContext:
    return request.app.state.ctx


class OpenAIAdmission(Admission):
    """Completions or chat: the OpenAI body, tokenized as ``generation.tokenize_prompts`` does."""

    def __init__(self, endpoint: str, parse):
        self.endpoint = endpoint
        self._parse = parse

    def parse(self, ctx: AppContext, body) -> GenerationRequest:
        body = with_default_model(body, ctx.served_model_name)
        req = self._parse(body, ctx.sampling_defaults, max_logprobs=ctx.settings.max_logprobs)
        chat_output.check_request(ctx, req)  # "auto" tool choice needs the server's tool-call parser
        apply_server_defaults(req, ctx.settings)
        return req


async def completions(request: Request) -> Response:
    return await generate(request, OpenAIAdmission("completion", parse_completion_request))


async def chat_completions(request: Request) -> Response:
    return await generate(request, OpenAIAdmission("chat", parse_chat_request))


async def generate(request: Request, steps: Admission, answer=None, events=None) -> Response:
    """Admit, run, answer: the chat or completions body, or ``answer(run, shaper, body)`` made of
    it; a stream of ``events(run, shaper)`` (SSE bytes), the chat or completions chunks by default."""
    arrival = time.monotonic()
    run = await admit(request, _ctx(request), steps, arrival)
    shaper = shaper_for(run)
    headers = run.rate_headers  # as of admission: a stream's headers go out before its first token
    if run.req.stream:
        return SSEResponse((events or _stream_events)(run, shaper), headers=headers,
                           on_close=lambda: run.close(CLIENT_CLOSED))
    try:
        body = await run_unless_disconnected(request, whole_answer(run, shaper, answer))
    except ClientDisconnected:
        run.close(CLIENT_CLOSED)
        return Response(status_code=CLIENT_CLOSED)
    except Exception as exc:  # an error answer of an admitted request carries the headers too
        err = from_exception(exc, request_id=run.request_id)
        err.headers = {**headers, **err.headers}
        raise err from None
    return JSONResponse(body, headers=headers)


def shaper_for(run: RequestRun) -> ResponseShaper:
    """The shaper of an admitted run's answer (its id is the run's request id, or the one vLLM's
    ``request_id`` field names)."""
    req = run.req
    answer_id = run.request_id if req.client_request_id is None else client_answer_id(req.kind, req.client_request_id)
    return ResponseShaper(req.kind, req.model, run.ctx.tokenizer, include_usage=req.include_usage,
                          response_id=answer_id, tokens_as_ids=bool(req.return_tokens_as_token_ids),
                          role=req.response_role)


async def whole_answer(run: RequestRun, shaper: ResponseShaper, answer=None) -> dict:
    """The non-streamed answer's body (``collect``'s, or ``answer(run, shaper, body)`` made of
    it); the run is closed either way, with the status its failure maps to (``CLIENT_CLOSED``
    when cancelled). The batch runner (batch_runner.py) answers each line with this too."""
    try:
        body = await collect(run, shaper)
    except BaseException as exc:
        err = from_exception(exc, log_unknown=False) if isinstance(exc, Exception) else None
        run.close(err.status if err else CLIENT_CLOSED)
        raise
    run.close(200)
    return answer(run, shaper, body) if answer is not None else body


def _echo_texts(run: RequestRun) -> list[str]:
    """Each prompt's echoed text (none without ``echo``), decoded once for all its choices."""
    if not run.req.echo:
        return []
    decode = run.ctx.tokenizer.decode
    return [prompt if isinstance(prompt, str) else decode(prompt) for prompt in run.req.prompts]


async def collect(run: RequestRun, shaper: ResponseShaper) -> dict:
    req = run.req
    n_choices = len(run.prompt_ids) * req.params.n
    pieces: list[list[str]] = [[] for _ in range(n_choices)]  # joined once: += would copy each time
    entries: list[list[dict]] = [[] for _ in range(n_choices)]
    finish: list[str | None] = [None] * n_choices
    token_ids: list[list[int]] = [[] for _ in range(n_choices)]
    stop_reasons: list[int | str | None] = [None] * n_choices
    parsed = chat_output.outputs_for(run)  # reasoning / "auto" tool calls read out of the text
    async for p_idx, choice, comp in run.deltas():
        pieces[choice].append(comp.text)
        token_ids[choice].extend(comp.token_ids)
        if comp.logprobs:
            entries[choice].extend(comp.logprobs)
        if comp.finish_reason is not None:
            finish[choice] = comp.finish_reason
            stop_reasons[choice] = comp.stop_reason
    if req.echo_without_generation:
        # the prompt only: the one token the engine ran is not shown, but how it ended is (vLLM
        # answers the engine's finish_reason and stop_reason: "stop" when that token was a stop)
        pieces, entries = [[] for _ in pieces], [[] for _ in entries]
    run.output_texts = texts = ["".join(p) for p in pieces]
    echoes = _echo_texts(run)
    choices = []
    for i in range(n_choices):
        p_idx = i // req.params.n
        prefix = echoes[p_idx] if req.echo else ""
        logprobs = None
        if req.logprobs and req.kind == "chat":
            logprobs = shaper.chat_logprobs(entries[i], req.top_logprobs)
        elif req.logprobs and req.echo:  # the prompt's tokens first, then the completion's
            prompt_entries = _prompt_entries(run, shaper, p_idx)
            offsets = (_prompt_offsets(run, shaper, p_idx, prompt_entries)
                       + _output_offsets(run, shaper, p_idx, len(prefix)).of(_ids(entries[i])))
            logprobs = shaper.completion_logprobs(prompt_entries + entries[i], req.top_logprobs, offsets)
        elif req.logprobs:
            offsets = _output_offsets(run, shaper, p_idx, len(prefix)).of(_ids(entries[i]))
            logprobs = shaper.completion_logprobs(entries[i], req.top_logprobs, offsets)
        choice = {"index": i, "text": prefix + texts[i], "logprobs": logprobs, "finish_reason": finish[i]}
        if req.kind == "chat" and req.tools.mode is not None:  # the output is a tool call's arguments
            choice["message"], called = reasoned_constraints.tool_message(run, texts[i])
            choice["finish_reason"] = tool_calls.finish_reason(req.tools.mode, finish[i], called)
        elif parsed is not None:
            choice["message"], choice["finish_reason"] = parsed().message(texts[i], finish[i])
        if req.prompt_logprobs is not None and req.kind == "completion":
            choice["prompt_logprobs"] = _vllm_prompt_logprobs(run, shaper, p_idx)
        choices.append(choice)
    build = shaper.chat_response if req.kind == "chat" else shaper.completion_response
    body = build(choices, run.prompt_tokens, run.completion_tokens, cached_tokens(run))
    if req.prompt_logprobs is not None and req.kind == "chat":  # vLLM: one prompt, at the top level
        body["prompt_logprobs"] = _vllm_prompt_logprobs(run, shaper, 0)
    for choice in body["choices"]:
        choice["stop_reason"] = stop_reasons[choice["index"]]
    if req.return_token_ids:
        add_to_answer(body, req.kind, run.prompt_ids, token_ids, req.params.n)
    return body


def cached_tokens(run: RequestRun) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens``: the prompt tokens the prefix cache served,
    with --enable-prompt-tokens-details (vLLM's flag; None: no details, vLLM's default). Unlike
    vLLM, a request with no hit says 0 rather than leaving the details out (OpenAI's form), and
    several prompts' counts add up, as their prompt_tokens do (vLLM reports one prompt's)."""
    return run.cached_tokens if run.ctx.settings.enable_prompt_tokens_details else None


def _prompt_entries(run: RequestRun, shaper: ResponseShaper, p_idx: int) -> list[dict]:
    computed = run.prompt_logprobs.get(p_idx)
    return shaper.prompt_entries(run.prompt_ids[p_idx], computed) if computed else []


def _ids(entries: list[dict]) -> list[int]:
    return [e["token_id"] for e in entries]


def _prompt_offsets(run: RequestRun, shaper: ResponseShaper, p_idx: int, entries: list[dict]) -> list[int]:
    """Text offsets of the echoed prompt's tokens in the echoed text: a text prompt as sent
    (its special tokens, a BOS, not in it), token ids as decoded (``_echo_texts``: kept)."""
    skip_special = isinstance(run.req.prompts[p_idx], str)
    return shaper.text_offsets([], skip_special).of(_ids(entries))


def _output_offsets(run: RequestRun, shaper: ResponseShaper, p_idx: int, start: int) -> TextOffsets:
    """Text offsets of a choice's output tokens, after ``start`` characters (an echoed prompt)."""
    return shaper.text_offsets(run.prompt_ids[p_idx], run.req.params.skip_special_tokens, start)


def _vllm_prompt_logprobs(run: RequestRun, shaper: ResponseShaper, p_idx: int) -> list | None:
    computed = run.prompt_logprobs.get(p_idx)
    return shaper.vllm_prompt_logprobs(computed, run.req.prompt_logprobs) if computed else None


async def _stream_events(run: RequestRun, shaper: ResponseShaper):
    req = run.req
    status = CLIENT_CLOSED
    try:
        try:
            async for chunk in chunks(run, shaper, text_events=True):
                yield chunk if type(chunk) is bytes else sse_event(chunk)
        except Exception as exc:  # headers are out: report in-band, as vLLM does
            err = from_exception(exc, request_id=run.request_id)
            status = err.status
            yield sse_event(err.body())
            yield DONE
            return
        if req.include_usage:
            yield sse_event(shaper.usage_chunk(run.prompt_tokens, run.completion_tokens, cached_tokens(run)))
        yield DONE
        status = 200
    finally:
        run.close(status)


async def chunks(run: RequestRun, shaper: ResponseShaper, text_events: bool = False):
    """The stream's chunks (dicts) up to each choice's finish reason, without the usage chunk;
    an engine failure is raised. The Responses API reads a chat stream from here too.
    ``text_events``: a plain text chunk (no finish reason, no logprobs: all but a few of a
    stream's) comes as its SSE event already (bytes, ``shaper.text_event``), not as a dict."""
    req = run.req
    ids = StreamTokenIds(req.kind, run.prompt_ids, req.params.n, len(run.prompt_ids) * req.params.n) \
        if req.return_token_ids else None
    stop_reasons: dict[int, int | str | None] = {}  # per choice, once it finished
    # a text event is bytes already: only where no token ids are stamped on the chunks
    async for chunk in _chunks(run, shaper, ids, stop_reasons, text_events and ids is None):
        if isinstance(chunk, bytes):
            yield chunk
            continue
        choice = chunk["choices"][0]  # vLLM's stop_reason on every chunk: set on the finishing one
        choice["stop_reason"] = stop_reasons.get(choice["index"]) if choice["finish_reason"] is not None else None
        yield ids.stamp(chunk) if ids is not None else chunk


async def _chunks(run: RequestRun, shaper: ResponseShaper, ids: StreamTokenIds | None,
                  stop_reasons: dict[int, int | str | None], text_events: bool):
    req = run.req
    n_choices = len(run.prompt_ids) * req.params.n
    if req.continuous_usage:
        shaper.track_usage([len(run.prompt_ids[i // req.params.n]) for i in range(n_choices)])
    echoes = _echo_texts(run)
    calls = None  # per choice, when the output is tool calls
    splits = None  # per choice, the reasoning before a tool choice's calls (None: no reasoning)
    parsed = None  # per choice, when the parsers read the text (reasoning, "auto" tool calls)
    if req.kind == "chat" and req.tools.mode is None and (maker := chat_output.outputs_for(run)) is not None:
        parsed = [maker() for _ in range(n_choices)]
    if req.kind == "chat" and req.tools.mode is not None:
        calls = [tool_calls.ToolCallStream(req.tools) for _ in range(n_choices)]
        splits = [reasoned_constraints.splitter(run) for _ in range(n_choices)]
        for i in range(n_choices):  # the role, then a named call's header (id, name)
            yield shaper.chunk(i, None, None, role=True)
            if splits[i] is not None:
                continue  # after the reasoning, with the first argument: no call if it never ends
            for entry in calls[i].start():
                yield shaper.chunk(i, None, None, tool_calls=[entry])
    elif req.kind == "chat":  # first chunk of each choice announces the role
        for i in range(n_choices):
            yield shaper.chunk(i, "", None, role=True)
    elif req.echo and not req.logprobs:
        for i in range(n_choices):
            yield shaper.chunk(i, echoes[i // req.params.n], None)
    # echo with logprobs: each choice's echo chunk carries the prompt's logprobs, which come
    # with the choice's first output
    echo_pending = set(range(n_choices)) if req.echo and req.logprobs else set()
    offsets: dict[int, TextOffsets] = {}  # choice -> its output tokens' text offsets, across deltas
    async for p_idx, choice, comp in run.deltas():
        if ids is not None:  # before this delta's chunks: they carry its ids
            ids.take(choice, comp.token_ids)
        if comp.finish_reason is not None:
            stop_reasons[choice] = comp.stop_reason  # vLLM's: the stop string or token id, else null
        if choice in echo_pending:
            echo_pending.discard(choice)
            prompt_entries = _prompt_entries(run, shaper, p_idx)
            prompt_part = shaper.completion_logprobs(prompt_entries, req.top_logprobs,
                                                     _prompt_offsets(run, shaper, p_idx, prompt_entries))
            yield shaper.chunk(choice, echoes[p_idx], None, prompt_part)
        shaper.count_tokens(choice, len(comp.token_ids))  # continuous usage: cumulative per choice
        if req.echo_without_generation:  # the prompt (echoed above) and the finish, no completion
            if comp.finish_reason is not None:
                yield shaper.chunk(choice, "", comp.finish_reason)
            continue
        if not comp.text and comp.finish_reason is None and not (req.logprobs and comp.logprobs):
            continue  # text held back (a partial character or a possible stop string)
        logprobs = None
        if req.logprobs and comp.logprobs:
            if req.kind == "chat":
                logprobs = shaper.chat_logprobs(comp.logprobs, req.top_logprobs)
            else:
                if choice not in offsets:
                    offsets[choice] = _output_offsets(run, shaper, p_idx, len(echoes[p_idx]) if req.echo else 0)
                logprobs = shaper.completion_logprobs(comp.logprobs, req.top_logprobs,
                                                      offsets[choice].of(_ids(comp.logprobs)))
        if calls is not None:
            for chunk in _tool_call_chunks(shaper, calls[choice], splits[choice], choice, comp, logprobs,
                                           req.tools.mode):
                yield chunk
            continue
        if parsed is not None:
            for chunk in chat_output.stream_chunks(shaper, parsed[choice], choice, comp, logprobs):
                yield chunk
            continue
        if req.kind == "chat" and comp.finish_reason is not None and comp.text:
            # OpenAI sends the finish reason on a chunk of its own with an empty delta
            yield shaper.chunk(choice, comp.text, None, logprobs)
            yield shaper.chunk(choice, None, comp.finish_reason)
        elif req.kind == "chat" and comp.finish_reason is not None:
            yield shaper.chunk(choice, None, comp.finish_reason, logprobs)
        elif text_events and comp.finish_reason is None and logprobs is None:
            yield shaper.text_event(choice, comp.text)
        else:
            yield shaper.chunk(choice, comp.text, comp.finish_reason, logprobs)


def _tool_call_chunks(shaper: ResponseShaper, stream: tool_calls.ToolCallStream, split, choice: int, comp,
                      logprobs, mode: str):
    """The chunks of one engine delta of a tool-call output: one per reasoning piece (``split``,
    with a reasoning parser) or ``tool_calls`` entry (the delta's logprobs ride on the first, or
    on an empty delta of their own), then the finish reason on a chunk of its own."""
    deltas = reasoned_constraints.tool_deltas(split, stream, comp.text, comp.finish_reason is not None)
    for k, delta in enumerate(deltas):
        chunk = shaper.chunk(choice, None, None, logprobs if k == 0 else None, tool_calls=delta.get("tool_calls"))
        if "reasoning" in delta:
            chunk["choices"][0]["delta"].update({field: delta["reasoning"] for field in chat_output.REASONING_FIELDS})
        yield chunk
    if not deltas and logprobs is not None:
        yield shaper.chunk(choice, None, None, logprobs)
    if comp.finish_reason is not None:
        reason = tool_calls.finish_reason(mode, comp.finish_reason, stream.called())
        yield shaper.chunk(choice, None, reason)


def _base_card(ctx: AppContext, created: int) -> dict:
    return {"id": ctx.served_model_name, "object": "model", "created": created, "owned_by": "loraplex",
            "root": ctx.served_model_name, "parent": None, "max_model_len": ctx.max_model_len}


def _adapter_card(ctx: AppContext, tenant: str, model: str, adapter, created: int) -> dict:
    """The card of ``model`` (``name`` or ``name@N``) of ``adapter`` (the registry's AdapterInfo)."""
    return {"id": model, "object": "model", "created": created, "owned_by": tenant,
            "root": adapter.name, "parent": ctx.served_model_name, "active_version": adapter.active_version}


async def _model_cards(request: Request) -> list[dict]:
    ctx = _ctx(request)
    tenant = await ctx.tenant_auth.tenant_for(request, request.path_params.get("tenant"))
    adapters = await run_in_threadpool(ctx.registry.list_adapters, tenant)
    created = int(time.time())
    data = [_base_card(ctx, created)]
    for a in adapters:
        if getattr(a, "active_version", None) is None:
            continue
        data.append(_adapter_card(ctx, tenant, a.name, a, created))
    return data


async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": await _model_cards(request)})


async def retrieve_model(request: Request) -> Response:
    """``GET /models/{model}`` (the openai client's ``models.retrieve``): the card of any name a
    request's ``model`` takes (the served name, ``name``, ``name@N``), as the list shows it;
    a name no request would run on is a 404."""
    ctx = _ctx(request)
    tenant = await ctx.tenant_auth.tenant_for(request, request.path_params.get("tenant"))
    model = request.path_params["model"]
    created = int(time.time())
    if model == ctx.served_model_name:
        return JSONResponse(_base_card(ctx, created))

    def lookup():
        # the registry's answer to a request's ``model`` (resolve_target), without fetching files
        version = ctx.registry.resolve(tenant, model)
        return ctx.registry.get_adapter(tenant, version.adapter)

    try:
        adapter = await run_in_threadpool(lookup)
    except Exception as exc:
        if getattr(exc, "http_status", None) in (400, 404):  # no such name, or never a name
            raise model_not_found(model) from None
        raise
    if adapter is None:  # deleted between the two reads
        raise model_not_found(model)
    return JSONResponse(_adapter_card(ctx, tenant, model, adapter, created))


def routes() -> list[Route]:
    out = []
    for prefix in ("/v1", "/t/{tenant}/v1"):
        out += [
            Route(prefix + "/completions", completions, methods=["POST"]),
            Route(prefix + "/chat/completions", chat_completions, methods=["POST"]),
            Route(prefix + "/models", list_models, methods=["GET"]),
            Route(prefix + "/models/{model:path}", retrieve_model, methods=["GET"]),
        ]
    return out

