"""Request fields loraplex does not implement, where ignoring them would change the output.

OpenAI ignores fields it does not know, and so does loraplex (``metadata``, ``store``,
``service_tier``, ``prediction``, vLLM's ``priority`` ... change nothing a client can see in the
answer). A field that asks for a different output (``"auto"`` tool calls, a suffix ...) is
another matter: answering as if it had not been sent would hand the
client text it did not ask for, without a word. Such a field is refused with a 400 in the
OpenAI envelope whose ``param`` names it, unless its value asks for nothing beyond what is
served anyway (``best_of`` equal to ``n``, an empty list, ``null``, a vLLM default). Structured
output is served (``structured_fields.py``), vLLM's prompt-side fields (chat template options,
truncation, special tokens: ``prompt_fields.py``), vLLM's beam search (``beam_fields.py``), and so are tools with ``tool_choice`` ``"none"``,
``"required"`` or a named function (``tool_calls.py``), and ``"auto"`` (the default when tools
are sent) when the server runs with ``--tool-call-parser``; without one, chat_output.py refuses
``"auto"`` with ``AUTO_TOOLS`` (it needs the server's option, which this table cannot see), as
vLLM refuses it when started without ``--enable-auto-tool-choice``.

The README's tenant API section lists the same fields; keep the two in step.
"""

from __future__ import annotations

from loraplex.server.errors import bad_request

BOTH = ("completion", "chat")


def _empty(v) -> bool:
    return v is None or v == "" or v == [] or v == {}


def _function_call(v, body) -> bool:
    return v in (None, "auto", "none")


def _functions(v, body) -> bool:
    return _empty(v) or body.get("function_call") == "none"


def _best_of(v, body) -> bool:
    return v is None or v == body.get("n", 1) or (v == 1 and body.get("n") is None)


def _falsy_or_null(v, body) -> bool:
    return v is None or v is False


def _text_only(v, body) -> bool:
    return v is None or v == ["text"]


def _unset(v, body) -> bool:
    return _empty(v)


# "auto" (tools without tool_choice mean "auto") on a server started without a tool-call parser
AUTO_TOOLS = (
    '"auto" tool choice is not supported by this server: it needs a parser for the model\'s own tool-call '
    'syntax, which the operator chooses with `loraplex serve --tool-call-parser NAME` (hermes, llama3_json; '
    'vLLM answers the same without --enable-auto-tool-choice); send `tool_choice` "required" or '
    '{"type": "function", "function": {"name": ...}} to have the output kept to the tools\' arguments, '
    'or "none" (tools sent without `tool_choice` mean "auto")'
)

# field -> (endpoints, accepted(value, body), why it is refused)
REFUSED_FIELDS: dict[str, tuple[tuple[str, ...], object, str]] = {
    "function_call": (("chat",), _function_call, "function calls are not supported"),
    "functions": (("chat",), _functions, "function calls are not supported"),
    "suffix": (("completion",), _unset, "`suffix` (insertion) is not supported"),
    "best_of": (BOTH, _best_of, "`best_of` other than `n` is not supported"),
    "echo": (("chat",), _falsy_or_null, "`echo` is not supported for chat completions"),
    "modalities": (("chat",), _text_only, "modalities other than text are not supported"),
    "audio": (("chat",), _unset, "audio output is not supported"),
    "web_search_options": (("chat",), _unset, "web search is not supported"),
    # vLLM's extra fields
    "logits_processors": (BOTH, _unset, "custom logits processors are not supported"),
    "prompt_embeds": (("completion",), _unset, "prompt embeddings are not supported"),
}


def refuse_unsupported(body: dict, kind: str) -> None:
    """400 on the first field of ``body`` that asks for something not implemented."""
    for name, (kinds, accepted, why) in REFUSED_FIELDS.items():
        if kind not in kinds or name not in body:
            continue
        if not accepted(body[name], body):
            raise bad_request(f"`{name}`: {why}.", param=name, code="unsupported_parameter")
