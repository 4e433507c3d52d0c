"""Request fields loraplex does not implement, where ignoring them would change the output.

OpenAI ignores fields it does not know, and so does loraplex (``metadata``, ``store``,
``service_tier``, ``parallel_tool_calls``, ``prediction``, vLLM's ``priority`` ... change nothing
a client can see in the answer). A field that asks for a different output (tool calls, a
suffix, beam search ...) is another matter: answering as if it had not been sent would hand the
client text it did not ask for, without a word. Such a field is refused with a 400 in the
OpenAI envelope whose ``param`` names it, unless its value asks for nothing beyond what is
served anyway (``tools`` with ``tool_choice: "none"``, ``best_of`` equal to ``n``, an empty
list, ``null``, a vLLM default). Structured output is served (``structured_fields.py``).

The README's tenant API section lists the same fields; keep the two in step.
"""

from __future__ import annotations

from loraplex.server.errors import bad_request

BOTH = ("completion", "chat")


def _empty(v) -> bool:
    return v is None or v == "" or v == [] or v == {}


def _tools(v, body) -> bool:
    return _empty(v) or body.get("tool_choice") == "none"


def _tool_choice(v, body) -> bool:
    # "auto" (the default) and "none" ask for no tool call by themselves; "required" or a
    # named function demand one
    return v in (None, "auto", "none")


def _functions(v, body) -> bool:
    return _empty(v) or body.get("function_call") == "none"


def _best_of(v, body) -> bool:
    return v is None or v == body.get("n", 1) or (v == 1 and body.get("n") is None)


def _falsy_or_null(v, body) -> bool:
    return v is None or v is False


def _true_or_null(v, body) -> bool:
    return v is None or v is True


def _text_only(v, body) -> bool:
    return v is None or v == ["text"]


def _unset(v, body) -> bool:
    return _empty(v)


def _stream_options(v, body) -> bool:
    return not isinstance(v, dict) or not v.get("continuous_usage_stats")


# field -> (endpoints, accepted(value, body), why it is refused)
REFUSED_FIELDS: dict[str, tuple[tuple[str, ...], object, str]] = {
    "tool_choice": (("chat",), _tool_choice, "tool calls are not supported; only \"auto\" or \"none\""),
    "tools": (("chat",), _tools, "tool calls are not supported (send `tool_choice: \"none\"` to pass tools unused)"),
    "function_call": (("chat",), _tool_choice, "function calls are not supported"),
    "functions": (("chat",), _functions, "function calls are not supported"),
    "suffix": (("completion",), _unset, "`suffix` (insertion) is not supported"),
    "best_of": (BOTH, _best_of, "`best_of` other than `n` is not supported"),
    "echo": (("chat",), _falsy_or_null, "`echo` is not supported for chat completions"),
    "modalities": (("chat",), _text_only, "modalities other than text are not supported"),
    "audio": (("chat",), _unset, "audio output is not supported"),
    "web_search_options": (("chat",), _unset, "web search is not supported"),
    # vLLM's extra fields
    "use_beam_search": (BOTH, _falsy_or_null, "beam search is not supported"),
    "bad_words": (BOTH, _unset, "`bad_words` is not supported"),
    "allowed_token_ids": (BOTH, _unset, "`allowed_token_ids` is not supported"),
    "logits_processors": (BOTH, _unset, "custom logits processors are not supported"),
    "truncate_prompt_tokens": (BOTH, _unset, "`truncate_prompt_tokens` is not supported"),
    "prompt_embeds": (("completion",), _unset, "prompt embeddings are not supported"),
    "return_tokens_as_token_ids": (BOTH, _falsy_or_null, "`return_tokens_as_token_ids` is not supported"),
    "add_generation_prompt": (("chat",), _true_or_null, "`add_generation_prompt: false` is not supported"),
    "continue_final_message": (("chat",), _falsy_or_null, "`continue_final_message` is not supported"),
    "chat_template": (("chat",), _unset, "a request-supplied chat template is not supported"),
    "chat_template_kwargs": (("chat",), _unset, "`chat_template_kwargs` are not supported"),
    "add_special_tokens": (BOTH, None, "`add_special_tokens` other than the default is not supported"),
    "stream_options": (BOTH, _stream_options, "`stream_options.continuous_usage_stats` is not supported"),
}


def refuse_unsupported(body: dict, kind: str) -> None:
    """400 on the first field of ``body`` that asks for something not implemented."""
    for name, (kinds, accepted, why) in REFUSED_FIELDS.items():
        if kind not in kinds or name not in body:
            continue
        value = body[name]
        if name == "add_special_tokens":  # vLLM's defaults: chat False (the template has them), completions True
            ok = value is None or value is (kind == "completion")
        else:
            ok = accepted(value, body)
        if not ok:
            param = "stream_options.continuous_usage_stats" if name == "stream_options" else name
            raise bad_request(f"`{param}`: {why}.", param=param, code="unsupported_parameter")
