"""Parsing and validating OpenAI request bodies into engine inputs.

Unknown fields are ignored, as OpenAI does, except those that would change the output and are not
implemented (``"auto"`` tool choice, ``suffix``, ``best_of`` != ``n`` ...): refused_fields.py
answers those with a 400. vLLM's ``use_beam_search`` and its fields are read by beam_fields.py. A
known field of the wrong type or out of range is a 400 whose ``param`` names the field. vLLM's
extra fields (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``prompt_logprobs``, ``structured_outputs`` and ``guided_*`` ...) are accepted
under vLLM's names so clients written for vLLM work unchanged; structured output fields are read by
structured_fields.py, tools and tool choice by tool_calls.py, the prompt-side fields (chat template
options, ``truncate_prompt_tokens``, ``add_special_tokens``) by prompt_fields.py.

A sampling field left out or null (``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``, an open ``max_tokens``) takes the server's default where it has one
(``SamplingDefaults``: the model's generation config, vLLM's ``--generation-config``), else the
library's; absent and null are the same, as in vLLM's request models.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from loraplex.engine.admission_order import PRIORITY_LIMIT
from loraplex.chat_content import text_part
from loraplex.generation_defaults import SamplingDefaults
from loraplex.sampling_params import InvalidRequestError, SamplingParams
from loraplex.server.chat_output import REASONING_FIELDS
from loraplex.server.beam_fields import BeamOptions, parse_beam_search
from loraplex.server.errors import bad_request
from loraplex.server.prompt_fields import PromptOptions, parse_prompt_options
from loraplex.server.refused_fields import refuse_unsupported
from loraplex.server.structured_fields import parse_structured_output
from loraplex.server.tool_calls import ToolRequest, parse_tools, template_tool_calls

CHAT_ROLES = ("system", "user", "assistant", "tool")
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
    prompt_logprobs: int | None = None  # vLLM's field: report the prompt's logprobs (top N)
    # False: max_tokens is the server's default (params.max_tokens, None if none) capped by what
    # the context leaves (request_checks.prepare)
    max_tokens_given: bool = False
    user: str | None = None
    prompt_options: PromptOptions = field(default_factory=PromptOptions)  # template, truncation, special tokens
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprob tokens as "token_id:<id>"; None: the server's
    response_role: str = "assistant"  # chat: the answer's role (request_defaults.py)
    priority: int = 0  # vLLM's: lower is admitted first (not under --scheduling-policy fcfs)
    beam: BeamOptions | None = None  # vLLM's use_beam_search: n beams instead of n samples

    @property
    def endpoint(self) -> str:
        """The access log's ``endpoint``."""
        return self.kind

    @property
    def has_text(self) -> bool:
        """Whether the tokenizer must run (a chat, or a text prompt; token-id prompts need none)."""
        return self.kind == "chat" or any(isinstance(p, str) for p in self.prompts)


# --- typed field readers ----------------------------------------------------------------------


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _get(body: dict, name: str, check, kind: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise bad_request(f"`{name}` must be {kind}, got {type(value).__name__}", param=name)
    return value


def _int(body, name, default=None, lo=None, hi=None):
    v = _get(body, name, _is_int, "an integer", default)
    _range(name, v, lo, hi)
    return v


def _num(body, name, default=None, lo=None, hi=None):
    v = _get(body, name, _is_number, "a number", default)
    _range(name, v, lo, hi)
    return float(v) if v is not None else None


def _bool(body, name, default=False):
    return _get(body, name, lambda v: isinstance(v, bool), "a boolean", default)


def _range(name, v, lo, hi) -> None:
    if v is None:
        return
    if lo is not None and v < lo:
        raise bad_request(f"`{name}` must be >= {lo}, got {v}", param=name)
    if hi is not None and v > hi:
        raise bad_request(f"`{name}` must be <= {hi}, got {v}", param=name)


def _stop(body) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("`stop` must be a non-empty string or a list of them", param="stop")
    return stop


def _bad_words(body) -> list[str] | None:
    words = body.get("bad_words")  # checked by SamplingParams
    return None if words is None or words == [] else words


def _int_list(body, name) -> list[int]:
    v = body.get(name)
    if v is None:
        return []
    if not isinstance(v, list) or not all(_is_int(t) and t >= 0 for t in v):
        raise bad_request(f"`{name}` must be a list of non-negative integers", param=name)
    return v


_TOKEN_KEY = re.compile(r"[0-9]+")


def _logit_bias(body) -> dict[int, float] | None:
    """OpenAI's ``logit_bias``: an object of token ids (JSON keys are strings; ints are taken
    too) to a bias; the values' range is SamplingParams's check. Ids past the vocabulary are
    refused once the model is known."""
    raw = body.get("logit_bias")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise bad_request("`logit_bias` must be an object mapping token ids to biases", param="logit_bias")
    out: dict[int, float] = {}
    for key, value in raw.items():
        if _is_int(key) and key >= 0:
            token = key
        elif isinstance(key, str) and _TOKEN_KEY.fullmatch(key):
            token = int(key)
        else:
            raise bad_request(
                f"`logit_bias` keys must be token ids (non-negative integers), got {key!r}", param="logit_bias"
            )
        out[token] = value
    return out


def _model(body) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` is required and must be a non-empty string", param="model")
    return model


def _stream(body) -> tuple[bool, bool, bool]:
    """``stream``, and whether usage comes at the end and on every chunk.

    vLLM's ``continuous_usage_stats`` puts usage on every chunk only when usage is included at
    all; vLLM's ``stream_options.include_usage`` defaults to true, so ``{"continuous_usage_stats":
    true}`` alone turns on both, and an explicit ``include_usage: false`` turns off both."""
    stream = _bool(body, "stream", False)
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


def _logprobs_cap(max_logprobs: int) -> int | None:
    """The parse-time bound of a logprobs count: the server's ``max_logprobs`` (-1: none here;
    the engine holds it to the vocabulary)."""
    return None if max_logprobs == -1 else max_logprobs


def _prompt_logprobs(body: dict, stream: bool, max_logprobs: int) -> int | None:
    """vLLM's ``prompt_logprobs`` (top N per prompt token); like vLLM, not with ``stream``."""
    n = _int(body, "prompt_logprobs", None, lo=0, hi=_logprobs_cap(max_logprobs))
    if n is not None and stream:
        raise bad_request("`prompt_logprobs` is not available with `stream`", param="prompt_logprobs")
    return n


def _sampling(body: dict, max_tokens: int | None, logprobs: int | None, defaults: SamplingDefaults) -> SamplingParams:
    """The sampling fields common to both endpoints, checked for type here and for range by
    SamplingParams (its InvalidRequestError already names the field). A field left out or null
    takes the server's default (``defaults``: the model's generation config, as vLLM), else the
    library's."""
    kwargs = dict(
        n=_int(body, "n", 1, lo=1),
        max_tokens=max_tokens,
        min_tokens=_int(body, "min_tokens", 0, lo=0),
        temperature=_num(body, "temperature", defaults.get("temperature", 1.0), lo=0.0, hi=2.0),
        top_p=_num(body, "top_p", defaults.get("top_p", 1.0), lo=0.0, hi=1.0),
        top_k=_int(body, "top_k", defaults.get("top_k", 0), lo=-1),
        min_p=_num(body, "min_p", defaults.get("min_p", 0.0), lo=0.0, hi=1.0),
        repetition_penalty=_num(body, "repetition_penalty", defaults.get("repetition_penalty", 1.0)),
        presence_penalty=_num(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=_num(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        seed=_int(body, "seed", None),
        stop=_stop(body),
        stop_token_ids=_int_list(body, "stop_token_ids"),
        ignore_eos=_bool(body, "ignore_eos", False),
        logprobs=logprobs,
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
        logit_bias=_logit_bias(body),
        allowed_token_ids=_int_list(body, "allowed_token_ids") if body.get("allowed_token_ids") is not None else None,
        bad_words=_bad_words(body),
    )
    if kwargs["top_p"] == 0.0:
        raise bad_request("`top_p` must be > 0", param="top_p")
    try:
        return SamplingParams(**kwargs)
    except InvalidRequestError as exc:
        raise bad_request(exc.message, param=exc.param, code=exc.code) from None


def _prompts(body) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_int(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise bad_request(
        "`prompt` must be a string, a list of strings, a list of token ids or a list of token id lists",
        param="prompt",
    )


def _messages(body) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"`{where}` must be an object", param=where)
        role = m.get("role")
        if role == "developer":  # OpenAI's newer name for system
            role = "system"
        if role not in CHAT_ROLES:
            raise bad_request(f"`{where}.role` must be one of {', '.join(CHAT_ROLES)}", param=f"{where}.role")
        msg: dict = {"role": role}
        calls = m.get("tool_calls") if role == "assistant" else None
        reasoning = _reasoning(m, where) if role == "assistant" else None
        if (calls or reasoning is not None) and m.get("content") is None:
            # an earlier turn of only tool calls or reasoning: null content (chat_output.py), "" or [] rendered
            msg["content"] = None
        else:
            msg["content"] = _content(m.get("content"), f"{where}.content")
        if calls:
            msg["tool_calls"] = template_tool_calls(calls, f"{where}.tool_calls")
        if reasoning is not None:  # under both names, as vLLM hands it to the template (vllm-project/vllm#33635)
            msg["reasoning"] = msg["reasoning_content"] = reasoning
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(f"`{where}.tool_call_id` must be a non-empty string (the id of the call answered)",
                                  param=f"{where}.tool_call_id")
            msg["tool_call_id"] = call_id
        if isinstance(m.get("name"), str):  # vLLM passes a message's name on to the template
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _reasoning(m: dict, where: str) -> str | None:
    """An earlier assistant turn's reasoning, as the response gave it (reasoning_parsers.py):
    ``reasoning`` (vLLM's name since vllm-project/vllm#27752) or ``reasoning_content`` (the older
    name, which Qwen3's template reads, and what DeepSeek's API and the Vercel AI SDK send back).
    Either is taken (vLLM reads only ``reasoning``, vllm-project/vllm#38488); both with different
    text is a 400 rather than one of them lost."""
    values = {}
    for key in REASONING_FIELDS:  # the names an answer gives it under
        value = m.get(key)
        if value is not None and not isinstance(value, str):
            raise bad_request(f"`{where}.{key}` must be a string or null, got {type(value).__name__}",
                              param=f"{where}.{key}")
        if value is not None:
            values[key] = value
    if len(set(values.values())) > 1:
        raise bad_request(f"`{where}.reasoning` and `{where}.reasoning_content` are two names for the same text; "
                          "they differ here (send one, or both the same)", param=f"{where}.reasoning_content")
    return next(iter(values.values()), None)


def _content(content, where: str) -> str | list[dict]:
    """A string as sent, or the text parts as ``{"type": "text", "text"}`` (only text parts are
    served); the chat template gets them in its content format when the prompt is rendered
    (loraplex/chat_content.py)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"`{where}` parts must be text parts", param=where)
            texts.append(part["text"])
        return [text_part(t) for t in texts]
    raise bad_request(f"`{where}` must be a string or a list of text parts", param=where)


def _priority(body: dict) -> int:
    """vLLM's request ``priority``; whether the policy uses it is checked with the limits."""
    return _int(body, "priority", 0, lo=-PRIORITY_LIMIT + 1, hi=PRIORITY_LIMIT - 1)


# --- the two endpoints ------------------------------------------------------------------------


def _open_max_tokens(given: int | None, defaults: SamplingDefaults) -> tuple[int | None, bool]:
    """``(max_tokens, given)``: the request's own (under the operator's ceiling), else the
    server's default, which ``request_checks.prepare`` caps by what the context leaves."""
    if given is not None:
        return defaults.capped(given), True
    return defaults.max_tokens, False


def parse_completion_request(body, defaults: SamplingDefaults | None = None,
                             max_logprobs: int = MAX_TOP_LOGPROBS) -> GenerationRequest:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    defaults = defaults or SamplingDefaults()
    model = _model(body)
    refuse_unsupported(body, "completion")
    prompts = _prompts(body)
    # absent: OpenAI's (and vLLM's) 16; an explicit null leaves it open, as vLLM's
    # CompletionRequest (max_tokens: int | None = 16): the server's default, else the context
    max_tokens, max_tokens_given = _open_max_tokens(_int(body, "max_tokens", None, lo=1), defaults)
    if "max_tokens" not in body:
        max_tokens, max_tokens_given = defaults.capped(16), True
    logprobs = _int(body, "logprobs", None, lo=0, hi=_logprobs_cap(max_logprobs))
    stream, include_usage, continuous_usage = _stream(body)
    echo = _bool(body, "echo", False)
    prompt_logprobs = _prompt_logprobs(body, stream, max_logprobs)
    params = _sampling(body, max_tokens, logprobs, defaults)
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
        return_tokens_as_token_ids=_bool(body, "return_tokens_as_token_ids", None),
        logprobs=logprobs is not None,
        top_logprobs=logprobs or 0,
        echo=echo,
        prompt_logprobs=prompt_logprobs,
        prompt_options=parse_prompt_options(body, "completion"),
        priority=_priority(body),
        max_tokens_given=max_tokens_given,
        user=body.get("user") if isinstance(body.get("user"), str) else None,
        beam=parse_beam_search(body, "completion"),
    )


def parse_chat_request(body, defaults: SamplingDefaults | None = None,
                       max_logprobs: int = MAX_TOP_LOGPROBS) -> GenerationRequest:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    defaults = defaults or SamplingDefaults()
    model = _model(body)
    refuse_unsupported(body, "chat")
    messages = _messages(body)
    max_tokens = _int(body, "max_completion_tokens", None, lo=1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None, lo=1)
    max_tokens, max_tokens_given = _open_max_tokens(max_tokens, defaults)
    want_logprobs = _bool(body, "logprobs", False)
    top_logprobs = _int(body, "top_logprobs", None, lo=0, hi=_logprobs_cap(max_logprobs))
    if top_logprobs is not None and not want_logprobs:
        raise bad_request("`top_logprobs` requires `logprobs` to be true", param="top_logprobs")
    stream, include_usage, continuous_usage = _stream(body)
    prompt_logprobs = _prompt_logprobs(body, stream, max_logprobs)
    params = _sampling(body, max_tokens, (top_logprobs or 0) if want_logprobs else None, defaults)
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
        return_tokens_as_token_ids=_bool(body, "return_tokens_as_token_ids", None),
        logprobs=want_logprobs,
        top_logprobs=top_logprobs or 0,
        max_tokens_given=max_tokens_given,
        priority=_priority(body),
        user=body.get("user") if isinstance(body.get("user"), str) else None,
        beam=parse_beam_search(body, "chat"),
    )
