"""OpenAI's Responses API, stateless: ``POST /t/{tenant}/v1/responses`` and ``POST
/v1/responses`` (the key's tenant).

The request is read as a chat request (responses_protocol.py) and runs the chat path whole:
the same admission, chat template, constraints and tool / reasoning parsers. The chat answer
(whole, or its stream's chunks) is then shaped as a ``response`` object or its semantic events
(responses_shapes.py), so a streamed answer's deltas join into the whole answer's items.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from loraplex.sampling_params import InvalidRequestError
from loraplex.server import chat_output
from loraplex.server.admission import Admission
from loraplex.server.context import AppContext
from loraplex.server.errors import CLIENT_CLOSED, APIError, from_exception
from loraplex.server.generation import RequestRun
from loraplex.server.openai_routes import chunks, generate
from loraplex.server.protocol import GenerationRequest, with_default_model
from loraplex.server.responses_options import auto_truncation_keep
from loraplex.server.responses_protocol import parse_responses_request, renamed
from loraplex.server.responses_shapes import (EventStream, add_logprobs, new_item_id, output_items, replay_items,
                                              response_object, sse, status_of, usage)
from loraplex.server.shapes import ResponseShaper


class ResponsesAdmission(Admission):
    """A Responses body, admitted as the chat request it maps to; errors name its own fields."""

    endpoint = "responses"

    def parse(self, ctx: AppContext, body) -> GenerationRequest:
        req = parse_responses_request(with_default_model(body, ctx.served_model_name), ctx.sampling_defaults,
                                      max_logprobs=ctx.settings.max_logprobs)
        if req.output_options.truncation == "auto":  # the prompt's last tokens, as vLLM keeps them
            opts = req.prompt_options
            opts.truncate_prompt_tokens = auto_truncation_keep(
                ctx.max_model_len, ctx.settings.max_prompt_tokens,
                req.params.max_tokens if req.max_tokens_given else None, opts.truncate_prompt_tokens)
        try:
            chat_output.check_request(ctx, req)  # "auto" tool choice needs the server's tool-call parser
        except APIError as exc:
            raise renamed(exc) from None
        return req

    def prompt_ids(self, ctx: AppContext, req: GenerationRequest) -> list[list[int]]:
        try:
            return super().prompt_ids(ctx, req)
        except (APIError, InvalidRequestError) as exc:
            raise renamed(from_exception(exc, log_unknown=False)) from None

    def request_id(self, req: GenerationRequest) -> str:
        return new_item_id("resp")

    def named(self, err: APIError) -> APIError:
        return renamed(err)


def answer_id(run: RequestRun) -> str:
    """The response's id: the run's, or vLLM's ``request_id`` field as the body gave it (vLLM
    names the response by it whole: it defaults to ``resp_...``)."""
    return run.req.client_request_id or run.request_id


def response_answer(run: RequestRun, shaper: ResponseShaper, chat: dict) -> dict:
    (choice,) = chat["choices"]
    maker = chat_output.outputs_for(run)
    if choice["message"].get("tool_calls") and maker is not None:
        # "auto" calls with text around them: chat joins all the text into one content, which
        # would put text written after a call before it; the items follow the output instead,
        # read as its stream is (the same deltas), so both answers hold the same items
        items = replay_items(maker(), run.output_texts[0], choice["finish_reason"])
    else:
        items = output_items(choice["message"], choice["finish_reason"])
    if run.req.output_options.logprobs:
        add_logprobs(items, (choice.get("logprobs") or {}).get("content") or [])
    return response_object(answer_id(run), shaper.created, run.req.model, run.req.echo_fields,
                           status_of(choice["finish_reason"]), items,
                           usage(run.prompt_tokens, run.completion_tokens, run.cached_tokens))


async def _events(run: RequestRun, shaper: ResponseShaper):
    stream = EventStream(answer_id(run), shaper.created, run.req.model, run.req.echo_fields)
    status = CLIENT_CLOSED
    try:
        for event in stream.start():
            yield sse(event)
        try:
            async for chunk in chunks(run, shaper):
                for event in stream.feed(chunk):
                    yield sse(event)
        except Exception as exc:  # headers are out: report in-band
            err = from_exception(exc, request_id=run.request_id)
            status = err.status
            for event in stream.failed(err.message):
                yield sse(event)
            return
        for event in stream.finish(run.prompt_tokens, run.completion_tokens, run.cached_tokens):
            yield sse(event)
        status = 200
    finally:
        run.close(status)


async def create_response(request: Request) -> Response:
    return await generate(request, ResponsesAdmission(), answer=response_answer, events=_events)


def routes() -> list[Route]:
    return [Route(prefix + "/responses", create_response, methods=["POST"]) for prefix in ("/v1", "/t/{tenant}/v1")]
