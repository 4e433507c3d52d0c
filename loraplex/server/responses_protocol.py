"""OpenAI's Responses API request (``POST /v1/responses``), read as the chat completions request
it asks for, so the chat path (template, admission, constraints, tool and reasoning parsers)
runs it unchanged.

Stateless: ``store`` is accepted and nothing is stored; what needs a stored response or a
server-side tool (``previous_response_id``, ``conversation``, ``background``, built-in tools,
images, files ...) is a 400 naming the field. The mapping:

- ``instructions`` -> a system message first; ``input`` (a string: one user message; or a list
  of items) -> ``messages``: a message item (``{"role", "content"}``, content a string or
  ``input_text`` / ``output_text`` parts, which become chat's text parts) is a message;
  ``function_call`` items join the assistant message before them as ``tool_calls``
  (``arguments`` as the template takes them); a ``function_call_output`` item is a ``tool``
  message (an ``output`` of parts: their texts joined with a newline, as vLLM renders tool
  results); a ``reasoning`` item (as a response gave it) is the next assistant turn's ``reasoning``.
- ``max_output_tokens`` -> ``max_completion_tokens``; ``temperature``, ``top_p``, ``user``,
  ``parallel_tool_calls`` as they are; ``tools`` (flat ``{"type": "function", "name", ...}``)
  -> chat's nested shape; ``tool_choice`` ``{"type": "function", "name"}`` -> chat's named
  choice; ``text.format`` -> ``response_format``; vLLM's sampling and prompt-side fields as
  they came. Chat's own spellings (``messages``, ``max_tokens``, ``response_format`` ...) and
  what one response cannot hold (``n``) are 400s, not dropped.
- ``include``, ``top_logprobs`` and ``truncation``: responses_options.py (logprobs are asked of
  the chat path as chat's ``logprobs`` / ``top_logprobs``, so they are chat's).

An error the chat path raises names chat's field; ``responses_param`` turns it into the
Responses field the client sent (``messages[...]`` -> ``input``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from loraplex.chat_content import text_part
from loraplex.generation_defaults import SamplingDefaults
from loraplex.server.errors import APIError, bad_request
from loraplex.server.protocol import MAX_TOP_LOGPROBS, GenerationRequest, parse_chat_request
from loraplex.server.responses_options import OutputOptions, parse_output_options

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = {"input_text", "output_text"}  # output_text: an earlier answer's message sent back
# OpenAI's, then vLLM's extra fields, which mean on /responses what they mean on chat (and are
# checked there): passed on as they came, never dropped
SAMPLING_FIELDS = (
    "temperature", "top_p", "user", "parallel_tool_calls",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "min_tokens", "ignore_eos", "skip_special_tokens",
    "include_stop_str_in_output", "allowed_token_ids", "bad_words", "cache_salt", "priority",
    # vLLM's prompt-side fields (prompt_fields.py): they change the prompt the same way here
    "chat_template_kwargs", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "truncate_prompt_tokens", "add_special_tokens",
)

# field -> (accepted(value), why it is refused); each a 400 naming the field, nothing started
_STATELESS = "this server is stateless (nothing is stored; send the whole conversation as `input`)"
REFUSED_FIELDS = {
    "previous_response_id": (lambda v: v is None, _STATELESS),
    "conversation": (lambda v: v is None, _STATELESS),
    "background": (lambda v: v in (None, False), "background responses are not supported"),
    "prompt": (lambda v: v is None, "stored prompt templates are not supported"),
    "max_tool_calls": (lambda v: v is None, "`max_tool_calls` (built-in tools) is not supported"),
    "reasoning": (lambda v: v in (None, {}) or (isinstance(v, dict) and all(x is None for x in v.values())),
                  "reasoning options (`effort`, `summary`) are not supported; the server's --reasoning-parser "
                  "decides what is reasoning"),
}
# chat completions' fields that /responses spells otherwise or does not serve: each changes the
# output, so a chat body sent here (or a client mixing the two APIs) is told, not answered as if
# the field had not been sent
_ONE_CONSTRAINT = "not read on /responses: send `text.format` (a JSON schema or a JSON object)"
REFUSED_FIELDS.update({
    "messages": (lambda v: v is None, "not read on /responses: send the conversation as `input`"),
    "max_tokens": (lambda v: v is None, "not read on /responses: send `max_output_tokens`"),
    "max_completion_tokens": (lambda v: v is None, "not read on /responses: send `max_output_tokens`"),
    "response_format": (lambda v: v in (None, {"type": "text"}), _ONE_CONSTRAINT),
    "structured_outputs": (lambda v: v in (None, {}), _ONE_CONSTRAINT),
    **{f"guided_{kind}": (lambda v: v is None, _ONE_CONSTRAINT) for kind in ("json", "regex", "choice", "grammar")},
    "n": (lambda v: v in (None, 1), "one output per response (`n` other than 1 is not served on /responses)"),
    "logprobs": (lambda v: v in (None, False),
                 'not read on /responses: send `include: ["message.output_text.logprobs"]` (and `top_logprobs`)'),
    "prompt_logprobs": (lambda v: v is None, "prompt logprobs are not served on /responses"),
    # vLLM's beam search (beam_fields.py) is served on completions and chat only; vLLM drops it here
    "use_beam_search": (lambda v: v in (None, False),
                        "beam search is not served on /responses: use /v1/chat/completions"),
})

# chat's field names in errors -> the Responses field that sent them
_PARAMS = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text.format", "response_format.json_schema": "text.format",
           "response_format.json_schema.schema": "text.format.schema", "prompt": "input"}


@dataclass
class ResponsesRequest(GenerationRequest):
    """A chat request, plus what the response object echoes back."""

    echo_fields: dict = field(default_factory=dict)
    output_options: OutputOptions = field(default_factory=OutputOptions)

    @property
    def endpoint(self) -> str:
        return "responses"


def responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    if param == "messages" or param.startswith("messages["):
        return "input"
    return _PARAMS.get(param, param)


def renamed(exc: APIError) -> APIError:
    """``exc`` naming the Responses field (and its message too) instead of chat's."""
    param = responses_param(exc.param)
    message = exc.message
    if exc.param and param != exc.param:
        message = message.replace(f"`{exc.param}`", f"`{param}`")
    if exc.param == "max_tokens":  # the context-length message names it without backticks
        message = message.replace("max_tokens", "`max_output_tokens`")
    return APIError(exc.status, message, param=param, code=exc.code, type=exc.type, headers=exc.headers)


def parse_responses_request(body, defaults: SamplingDefaults | None = None,
                            max_logprobs: int = MAX_TOP_LOGPROBS) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    for name, (accepted, why) in REFUSED_FIELDS.items():
        if name in body and not accepted(body[name]):
            raise bad_request(f"`{name}`: {why}.", param=name, code="unsupported_parameter")
    options = parse_output_options(body, max_logprobs)
    chat: dict = {"model": body.get("model"), "messages": _messages(body)}
    if options.logprobs:
        chat.update(logprobs=True, top_logprobs=options.top_logprobs)
    for name in SAMPLING_FIELDS:
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]
    if body.get("request_id") is not None:  # vLLM's: the response's id, as given
        chat["request_id"] = body["request_id"]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    metadata = _metadata(body.get("metadata"))
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise bad_request("`store` must be a boolean", param="store")
    try:
        req = parse_chat_request(chat, defaults, max_logprobs=max_logprobs)
    except APIError as exc:
        raise renamed(exc) from None
    echo = {  # the request's settings, as OpenAI's response object repeats them
        "instructions": body.get("instructions"), "metadata": metadata or {},
        "max_output_tokens": body.get("max_output_tokens"), "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "temperature": req.params.temperature, "top_p": req.params.top_p,
        "parallel_tool_calls": req.tools.parallel, "user": req.user, "store": bool(store),
        "top_logprobs": options.top_logprobs, "truncation": options.truncation,
    }
    return ResponsesRequest(**{f.name: getattr(req, f.name) for f in fields(GenerationRequest)}, echo_fields=echo,
                            output_options=options)


# --- input ------------------------------------------------------------------------------------


def _messages(body: dict) -> list[dict]:
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("`instructions` must be a string", param="instructions")
    out = [{"role": "system", "content": instructions}] if instructions else []
    raw = body.get("input")
    if isinstance(raw, str):
        return out + [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad_request("`input` must be a string or a non-empty list of items", param="input")
    reasoning = None  # a reasoning item waits for the assistant turn it belongs to
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"`{where}` must be an object", param=where)
        kind = item.get("type", "message")
        if reasoning is not None and kind in ("message", "function_call_output") and item.get("role") != "assistant":
            # reasoning with no answer after it: an assistant turn of its own
            out.append({"role": "assistant", "content": None, "reasoning": reasoning})
            reasoning = None
        if kind == "message":
            msg = _message(item, where)
            if msg["role"] == "assistant" and reasoning is not None:
                msg["reasoning"], reasoning = reasoning, None
            out.append(msg)
        elif kind == "function_call":
            call = _function_call(item, where)
            last = out[-1] if out and out[-1]["role"] == "assistant" and reasoning is None else None
            if last is None:
                last = {"role": "assistant", "content": None}
                if reasoning is not None:
                    last["reasoning"], reasoning = reasoning, None
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = _function_output(item, where)
            called = {c["id"] for m in out for c in m.get("tool_calls", ())}
            if output["tool_call_id"] not in called:  # stateless: the call must come with its output (OpenAI's 400)
                raise bad_request(f"`{where}.call_id`: no function_call item with call_id "
                                  f"{output['tool_call_id']!r} comes before this output", param=f"{where}.call_id")
            out.append(output)
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            if text:  # one with no text (OpenAI's encrypted or summary-only items) carries nothing to render
                reasoning = (reasoning or "") + text
        else:
            raise bad_request(f"`{where}.type` {kind!r} is not supported (served: message, function_call, "
                              "function_call_output, reasoning)", param=f"{where}.type", code="unsupported_parameter")
    if reasoning is not None:  # reasoning with no answer after it: an assistant turn of its own
        out.append({"role": "assistant", "content": None, "reasoning": reasoning})
    return out


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise bad_request(f"`{where}.role` must be one of {', '.join(MESSAGE_ROLES)}", param=f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise bad_request(f"`{where}.content` must be a string or a list of text parts", param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise bad_request(f"`{at}`: only text parts (input_text, output_text) are served; images, files and "
                              f"audio are not (got {kind!r})", param=at, code="unsupported_parameter")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"`{at}.text` must be a string", param=f"{at}.text")
        texts.append(part["text"])
    # chat's text parts: the template gets them in its content format, as vLLM hands input_text /
    # output_text parts to its chat parser (joined with "\n" for a string template)
    return {"role": role, "content": [text_part(t) for t in texts]}


def _function_call(item: dict, where: str) -> dict:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
            raise bad_request(f"`{where}.{key}` must be a {'non-empty ' if key != 'arguments' else ''}string",
                              param=f"{where}.{key}")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _function_output(item: dict, where: str) -> dict:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"`{where}.call_id` must be a non-empty string", param=f"{where}.call_id")
    if isinstance(output, list):  # the newer form: content parts, text only here
        output = _message({"role": "user", "content": output}, where)["content"]
    elif not isinstance(output, str):
        raise bad_request(f"`{where}.output` must be a string", param=f"{where}.output")
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def _reasoning_text(item: dict, where: str) -> str:
    content = item.get("content") or []
    if not isinstance(content, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                for p in content):
        raise bad_request(f"`{where}.content` must be a list of reasoning_text parts", param=f"{where}.content")
    return "".join(p["text"] for p in content)


# --- tools and text format ---------------------------------------------------------------------


def _tools(raw) -> list[dict]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad_request("`tools` must be a list of function tools", param="tools")
    out = []
    for i, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(f"`tools[{i}]`: only function tools are served ({kind!r} is a built-in tool this "
                              "server does not run)", param="tools", code="unsupported_parameter")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice):
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise bad_request('`tool_choice` must be "none", "auto", "required" or {"type": "function", "name": ...}; '
                      "built-in tools are not served", param="tool_choice", code="unsupported_parameter")


def _metadata(metadata):
    """OpenAI's limits: at most 16 pairs, keys up to 64 characters, string values up to 512."""
    if metadata is None:
        return None
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise bad_request("`metadata` must be an object of string values", param="metadata")
    if len(metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items()):
        raise bad_request("`metadata`: at most 16 pairs, keys up to 64 characters, values up to 512", param="metadata")
    return metadata


def _text_format(text) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("`text` must be an object", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema, name = fmt.get("schema"), fmt.get("name")
        if not isinstance(name, str) or not name:  # OpenAI requires it (chat's json_schema.name too)
            raise bad_request("`text.format.name` must be a non-empty string", param="text.format.name")
        if not isinstance(schema, dict):
            raise bad_request("`text.format.schema` must be a JSON schema (an object)", param="text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                       "strict": fmt.get("strict")}}
    raise bad_request('`text.format` must be {"type": "text"}, {"type": "json_object"} or '
                      '{"type": "json_schema", "name", "schema", "strict"}', param="text.format")

