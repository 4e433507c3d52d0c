"""vLLM's tokenizer routes, per tenant: ``POST /tokenize`` and ``POST /detokenize``.

Paths: at the root as vLLM serves them (the key decides the tenant), under ``/t/{tenant}``, and
under ``/v1`` and ``/t/{tenant}/v1`` as SGLang also serves them, so a client whose base URL ends
in ``/v1`` finds them too. Shapes are vLLM's (``TokenizeCompletionRequest``,
``TokenizeChatRequest``, ``DetokenizeRequest`` in vllm/entrypoints/openai/protocol.py):

- ``{"model"?, "prompt": str, "add_special_tokens"?: true, "return_token_strs"?: false}`` or
  ``{"model"?, "messages": [...], "tools"?, "documents"?, "add_generation_prompt"?,
  "continue_final_message"?, "chat_template"?, "chat_template_kwargs"?, "add_special_tokens"?:
  false, ...}`` -> ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` null
  unless asked). The ids are those completions or chat completions would run for the same prompt
  and prompt fields (prompt_fields.py; ``truncate_prompt_tokens`` and ``documents`` too, which
  vLLM's tokenize request lacks).
- ``{"model"?, "tokens": [int]}`` -> ``{"prompt": str}`` (special tokens kept, as vLLM decodes).

``model``, when sent, must be the base model or one of the caller's adapters: the same 404 as
chat completions otherwise. The adapter is only looked up (every adapter shares the base
model's tokenizer): nothing is pinned, fetched or loaded. Left out (or null, or ""), it is the base
model (vLLM).

``POST /tokenize`` is LoRAX's (TGI's) route too: a body with ``inputs`` is LoRAX's request and
gets LoRAX's answer and error shape (tgi_info.py). Everything else gets vLLM's, in the OpenAI
error envelope.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from loraplex.sampling_params import SamplingParams
from loraplex.server import tgi_info
from loraplex.server.admission import authenticate, check_model
from loraplex.server.body_fields import is_int, read_bool
from loraplex.server.chat_messages import parse_messages
from loraplex.server.context import AppContext
from loraplex.server.errors import bad_request
from loraplex.server.generation import tokenize_prompts, vocab_size
from loraplex.server.limits import read_json
from loraplex.server.prompt_fields import parse_prompt_options
from loraplex.server.protocol import GenerationRequest
from loraplex.server.tool_calls import parse_tools


def _model(body: dict, served_model: str) -> str:
    model = body.get("model")
    if model is None or model == "":  # vLLM: an empty name is the base model too
        return served_model
    if not isinstance(model, str) or not model:
        raise bad_request("`model` must be a non-empty string", param="model")
    return model


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def parse_tokenize_request(body, served_model: str) -> tuple[GenerationRequest, bool]:
    """``(request, return_token_strs)``: the prompt as the completions or chat request that
    would run it."""
    body = _object(body)
    model = _model(body, served_model)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt and has_messages:
        raise bad_request("Only one of `prompt` or `messages` should be provided.", param="messages")
    if not has_prompt and not has_messages:
        raise bad_request("`prompt` (a string) or `messages` (a chat) is required", param="prompt")
    token_strs = read_bool(body, "return_token_strs", False)
    params = SamplingParams()
    if has_prompt:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad_request("`prompt` must be a string", param="prompt")
        return GenerationRequest(kind="completion", model=model, params=params, prompts=[prompt],
                                 prompt_options=parse_prompt_options(body, "completion")), token_strs
    messages = parse_messages(body)
    # tools reach the template; tool_choice asks for nothing here (nothing is generated)
    tools = parse_tools({"tools": body.get("tools")})
    return GenerationRequest(kind="chat", model=model, params=params, messages=messages, tools=tools,
                             prompt_options=parse_prompt_options(body, "chat", messages)), token_strs


def parse_detokenize_request(body, served_model: str) -> tuple[str, list[int]]:
    body = _object(body)
    model = _model(body, served_model)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(is_int(t) and t >= 0 for t in tokens):
        raise bad_request("`tokens` must be a list of non-negative integers (token ids)", param="tokens")
    return model, tokens


async def tokenize(request: Request) -> Response:
    ctx: AppContext = request.app.state.ctx
    body = await read_json(request, ctx.settings.max_body_bytes)
    if isinstance(body, dict) and "inputs" in body:  # LoRAX's TokenizeRequest
        return await tgi_info.tokenize(request, ctx, body)
    tenant = await authenticate(ctx, request)
    req, token_strs = parse_tokenize_request(body, ctx.served_model_name)
    await check_model(ctx, tenant, req.model)
    ids, strs = await ctx.run_tokenizer(_tokens_and_strs, ctx, req, token_strs)
    return JSONResponse({"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": strs})


def _tokens_and_strs(ctx: AppContext, req: GenerationRequest, token_strs: bool) -> tuple[list[int], list | None]:
    """On the tokenizer thread, both: the pieces of a long prompt take as long to look up as its
    ids, and on the event loop that would hold every open stream."""
    ids = tokenize_prompts(ctx, req)[0]
    return ids, list(ctx.tokenizer.convert_ids_to_tokens(ids)) if token_strs else None


async def detokenize(request: Request) -> Response:
    ctx: AppContext = request.app.state.ctx
    tenant = await authenticate(ctx, request)
    model, tokens = parse_detokenize_request(await read_json(request, ctx.settings.max_body_bytes),
                                             ctx.served_model_name)
    await check_model(ctx, tenant, model)
    # ids past what the tokenizer knows would decode to nothing, silently
    limit = min(vocab_size(ctx), len(ctx.tokenizer))
    if any(t >= limit for t in tokens):
        raise bad_request(f"`tokens`: token ids must be < {limit} (the vocabulary)", param="tokens")
    return JSONResponse({"prompt": await ctx.run_tokenizer(ctx.tokenizer.decode, tokens)})


def routes() -> list[Route]:
    out = []
    for prefix in ("", "/t/{tenant}", "/v1", "/t/{tenant}/v1"):
        out += [
            Route(prefix + "/tokenize", tokenize, methods=["POST"]),
            Route(prefix + "/detokenize", detokenize, methods=["POST"]),
        ]
    return out
