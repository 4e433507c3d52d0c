"""Parsing and validating OpenAI request bodies into engine inputs.

Unknown fields are ignored, as OpenAI does, except those that would change the output and are not
implemented (``"auto"`` tool choice, ``suffix``, ``best_of`` != ``n`` ...): refused_fields.py
answers those with a 400. vLLM's ``use_beam_search`` and its fields are read by beam_fields.py. A
known field of the wrong type or out of range is a 400 whose ``param`` names the field. vLLM's
extra fields (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``prompt_logprobs``, ``structured_outputs`` and ``guided_*`` ...) are accepted
under vLLM's names so clients written for vLLM work unchanged; the sampling fields are read by
sampling_fields.py, structured output fields by structured_fields.py, a chat's ``messages`` by
chat_messages.py, tools and tool choice by tool_calls.py, the prompt-side fields (chat template
options, ``truncate_prompt_tokens``, ``add_special_tokens``) by prompt_fields.py; the typed field
readers they share are body_fields.py.

A sampling field left out or null (``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``, an open ``max_tokens``) takes the server's default where it has one
(``SamplingDefaults``: the model's generation config, vLLM's ``--generation-config``), else the
library's; absent and null are the same, as in vLLM's request models.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.engine.admission_order import PRIORITY_LIMIT
from loraplex.generation_defaults import SamplingDefaults
from loraplex.sampling_params import SamplingParams
from loraplex.server.beam_fields import BeamOptions, parse_beam_search
from loraplex.server.body_fields import is_int, read_bool, read_int, read_str
from loraplex.server.chat_messages import parse_messages
from loraplex.server.errors import bad_request
from loraplex.server.prompt_fields import PromptOptions, parse_prompt_options
from loraplex.server.refused_fields import refuse_unsupported
from loraplex.server.request_ids import MAX_CLIENT_REQUEST_ID_LENGTH, valid_client_id
from loraplex.server.sampling_fields import logprobs_cap, parse_sampling
from loraplex.server.structured_fields import parse_structured_output
from loraplex.server.tool_calls import ToolRequest, parse_tools
MAX_TOP_LOGPROBS = 20  # the default of the server's --max-logprobs (vLLM's, and OpenAI's chat limit)


@dataclass
class GenerationRequest:
    """A validated completions or chat request, before tokenization."""

    kind: str  # "completion" | "chat"
    model: str
    params: SamplingParams
    prompts: list[str | list[int]] = field(default_factory=list)  # completions
    messages: list[dict] = field(default_factory=list)  # chat: content str, text parts or None (chat_content.py)
    tools: ToolRequest = field(default_factory=ToolRequest)  # chat: tools for the template, tool choice
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage on every chunk
    logprobs: bool = False  # report logprobs in the response
    top_logprobs: int = 0
    echo: bool = False
    echo_without_generation: bool = False  # completions' echo with max_tokens 0: the prompt, no completion
    prompt_logprobs: int | None = None  # vLLM's field: report the prompt's logprobs (top N)
    # False: max_tokens is the server's default (params.max_tokens, None if none) capped by what
    # the context leaves (request_checks.prepare)
    max_tokens_given: bool = False
    user: str | None = None
    prompt_options: PromptOptions = field(default_factory=PromptOptions)  # template, truncation, special tokens
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprob tokens as "token_id:<id>"; None: the server's
    return_token_ids: bool = False  # vLLM's: prompt_token_ids and token_ids alongside the text (token_ids_output.py)
    response_role: str = "assistant"  # chat: the answer's role (request_defaults.py)
    priority: int = 0  # vLLM's: lower is admitted first (not under --scheduling-policy fcfs)
    # vLLM's request_id: the answer's id is "<prefix>-<it>" (shapes.client_answer_id); logged as
    # client_request_id where no X-Request-Id header came
    client_request_id: str | None = None
    beam: BeamOptions | None = None  # vLLM's use_beam_search: n beams instead of n samples

    @property
    def endpoint(self) -> str:
        """The access log's ``endpoint``."""
        return self.kind

    @property
    def has_text(self) -> bool:
        """Whether the tokenizer must run (a chat, or a text prompt; token-id prompts need none)."""
        return self.kind == "chat" or any(isinstance(p, str) for p in self.prompts)


# --- fields of both endpoints (the typed readers: body_fields.py) -----------------------------


def _client_request_id(body: dict) -> str | None:
    """vLLM's ``request_id`` field; 1 to 128 visible ASCII characters (it becomes the answer's
    id, its header and a log field), else a 400."""
    value = read_str(body, "request_id")
    if value is not None and valid_client_id(value) is None:
        raise bad_request(f"`request_id` must be 1 to {MAX_CLIENT_REQUEST_ID_LENGTH} visible ASCII characters "
                          "(no spaces)", param="request_id")
    return value


def _model(body) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` must be a string (or left out: the base model)", param="model")
    return model


def with_default_model(body, served_model: str):
    """``body`` with vLLM's default ``model``: a request that leaves it out, sends null or sends
    "" is for the base model (vLLM's request models have ``model: str | None = None``, and its
    ``_is_model_supported`` takes any empty name as the base model's)."""
    if isinstance(body, dict) and body.get("model") in (None, ""):
        return {**body, "model": served_model}
    return body


def _stream(body) -> tuple[bool, bool, bool]:
    """``stream``, and whether usage comes at the end and on every chunk.

    vLLM's ``continuous_usage_stats`` puts usage on every chunk only when usage is included at
    all; vLLM's ``stream_options.include_usage`` defaults to true, so ``{"continuous_usage_stats":
    true}`` alone turns on both, and an explicit ``include_usage: false`` turns off both."""
    stream = read_bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = continuous = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad_request("`stream_options` must be an object", param="stream_options")
        for name in ("include_usage", "continuous_usage_stats"):
            if opts.get(name) is not None and not isinstance(opts[name], bool):
                raise bad_request(f"`stream_options.{name}` must be a boolean", param=f"stream_options.{name}")
        continuous = bool(opts.get("continuous_usage_stats"))
        iu = opts.get("include_usage")
        include_usage = bool(iu) or (iu is None and continuous)
        continuous = continuous and include_usage
        if not stream and include_usage:
            raise bad_request("`stream_options` is only allowed when `stream` is true", param="stream_options")
    return stream, include_usage, continuous


def _prompt_logprobs(body: dict, stream: bool, max_logprobs: int) -> int | None:
    """vLLM's ``prompt_logprobs`` (top N per prompt token); like vLLM, not with ``stream``."""
    n = read_int(body, "prompt_logprobs", None, lo=0, hi=logprobs_cap(max_logprobs))
    if n is not None and stream:
        raise bad_request("`prompt_logprobs` is not available with `stream`", param="prompt_logprobs")
    return n


def _prompts(body) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(is_int(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(is_int(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise bad_request(
        "`prompt` must be a string, a list of strings, a list of token ids or a list of token id lists",
        param="prompt",
    )


def _priority(body: dict) -> int:
    """vLLM's request ``priority``; whether the policy uses it is checked with the limits."""
    return read_int(body, "priority", 0, lo=-PRIORITY_LIMIT + 1, hi=PRIORITY_LIMIT - 1)


# --- the two endpoints ------------------------------------------------------------------------


def _start(body, kind: str, defaults: SamplingDefaults | None) -> tuple[SamplingDefaults, str]:
    """What both endpoints check first: a JSON object, its ``model``, no refused field (of
    ``kind``'s); with the server's sampling defaults (none: the library's)."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    defaults = defaults or SamplingDefaults()
    model = _model(body)
    refuse_unsupported(body, kind)
    return defaults, model


def _open_max_tokens(given: int | None, defaults: SamplingDefaults) -> tuple[int | None, bool]:
    """``(max_tokens, given)``: the request's own (under the operator's ceiling), else the
    server's default, which ``request_checks.prepare`` caps by what the context leaves."""
    if given is not None:
        return defaults.capped(given), True
    return defaults.max_tokens, False


def _echo_without_generation(body: dict, echo: bool) -> bool:
    """``echo`` with ``max_tokens: 0``: the prompt (and, with ``logprobs``, its logprobs) and no
    completion, as OpenAI's legacy completions and vLLM answer it (prompt scoring); the engine
    still runs one step, as vLLM's does. ``max_tokens: 0`` without ``echo`` stays a 400."""
    return echo and is_int(body.get("max_tokens")) and body["max_tokens"] == 0


def parse_completion_request(body, defaults: SamplingDefaults | None = None,
                             max_logprobs: int = MAX_TOP_LOGPROBS) -> GenerationRequest:
    defaults, model = _start(body, "completion", defaults)
    prompts = _prompts(body)
    # absent: OpenAI's (and vLLM's) 16; an explicit null leaves it open, as vLLM's
    # CompletionRequest (max_tokens: int | None = 16): the server's default, else the context
    echo = read_bool(body, "echo", False)
    echo_only = _echo_without_generation(body, echo)
    max_tokens, max_tokens_given = _open_max_tokens(1 if echo_only else read_int(body, "max_tokens", None, lo=1),
                                                    defaults)
    if "max_tokens" not in body:
        max_tokens, max_tokens_given = defaults.capped(16), True
    logprobs = read_int(body, "logprobs", None, lo=0, hi=logprobs_cap(max_logprobs))
    stream, include_usage, continuous_usage = _stream(body)
    prompt_logprobs = _prompt_logprobs(body, stream, max_logprobs)
    params = parse_sampling(body, max_tokens, logprobs, defaults)
    params.structured_outputs = parse_structured_output(body)
    # echo with logprobs lists the prompt tokens' logprobs before the completion's (OpenAI)
    wanted = [n for n in (prompt_logprobs, logprobs if echo else None) if n is not None]
    params.prompt_logprobs = max(wanted) if wanted else None
    return GenerationRequest(
        kind="completion",
        model=model,
        params=params,
        prompts=prompts,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        return_tokens_as_token_ids=read_bool(body, "return_tokens_as_token_ids", None),
        return_token_ids=bool(read_bool(body, "return_token_ids", False)),
        logprobs=logprobs is not None,
        top_logprobs=logprobs or 0,
        echo=echo,
        echo_without_generation=echo_only,
        prompt_logprobs=prompt_logprobs,
        prompt_options=parse_prompt_options(body, "completion"),
        priority=_priority(body),
        max_tokens_given=max_tokens_given,
        user=read_str(body, "user"),
        client_request_id=_client_request_id(body),
        beam=parse_beam_search(body, "completion"),
    )


def parse_chat_request(body, defaults: SamplingDefaults | None = None,
                       max_logprobs: int = MAX_TOP_LOGPROBS) -> GenerationRequest:
    defaults, model = _start(body, "chat", defaults)
    messages = parse_messages(body)
    max_tokens = read_int(body, "max_completion_tokens", None, lo=1)
    if max_tokens is None:
        max_tokens = read_int(body, "max_tokens", None, lo=1)
    max_tokens, max_tokens_given = _open_max_tokens(max_tokens, defaults)
    want_logprobs = read_bool(body, "logprobs", False)
    top_logprobs = read_int(body, "top_logprobs", None, lo=0, hi=logprobs_cap(max_logprobs))
    if top_logprobs is not None and not want_logprobs:
        raise bad_request("`top_logprobs` requires `logprobs` to be true", param="top_logprobs")
    stream, include_usage, continuous_usage = _stream(body)
    prompt_logprobs = _prompt_logprobs(body, stream, max_logprobs)
    params = parse_sampling(body, max_tokens, (top_logprobs or 0) if want_logprobs else None, defaults)
    tools = parse_tools(body)
    params.structured_outputs = parse_structured_output(body)
    if tools.constraint is not None:
        if params.structured_outputs is not None:
            raise bad_request(
                "`tool_choice`: one constraint per request; a named or \"required\" tool choice keeps the output to "
                "the tools' arguments, so it cannot be sent with `response_format`, `structured_outputs` or `guided_*`",
                param="tool_choice",
            )
        params.structured_outputs = tools.constraint
    params.prompt_logprobs = prompt_logprobs
    return GenerationRequest(
        kind="chat",
        tools=tools,
        prompt_logprobs=prompt_logprobs,
        model=model,
        params=params,
        messages=messages,
        prompt_options=parse_prompt_options(body, "chat", messages),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        return_tokens_as_token_ids=read_bool(body, "return_tokens_as_token_ids", None),
        return_token_ids=bool(read_bool(body, "return_token_ids", False)),
        logprobs=want_logprobs,
        top_logprobs=top_logprobs or 0,
        max_tokens_given=max_tokens_given,
        priority=_priority(body),
        user=read_str(body, "user"),
        client_request_id=_client_request_id(body),
        beam=parse_beam_search(body, "chat"),
    )
