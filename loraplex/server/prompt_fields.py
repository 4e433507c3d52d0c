"""vLLM's prompt-side request fields: how the chat template renders the conversation, and how a
prompt becomes the token ids the engine runs.

Chat: ``chat_template_kwargs`` (extra variables for the template, e.g. Qwen3's
``{"enable_thinking": false}``), ``documents`` (RAG documents for templates that render them, such
as Command-R's or Granite's), ``add_generation_prompt`` (default true),
``continue_final_message`` (default false), ``chat_template`` (a template of the request's own,
refused unless the server trusts request templates; checked in generation.py, which knows the
settings). Both endpoints: ``truncate_prompt_tokens`` and ``add_special_tokens``. The meanings are
vLLM's (``ChatCompletionRequest`` / ``CompletionRequest`` in vllm/entrypoints/openai/protocol.py);
generation.py applies them.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

from loraplex.server.body_fields import lax_bool
from loraplex.server.errors import bad_request

# what loraplex hands the template itself: the conversation under both names
# (``apply_chat_template(conversation)`` renders it as ``messages``) and apply_chat_template's
# own parameters. vLLM refuses ``chat_template`` and ``tokenize`` among the kwargs
# (vllm-project/vllm#25794, after GHSA-6fvq-23cw-5628) and lets the request's own fields win
# over the others; a 400 says it instead of letting one of two values lose quietly.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
})


@functools.lru_cache(maxsize=1)
def reserved_template_kwargs() -> frozenset[str]:
    """The names above, plus every named parameter of the installed transformers'
    ``apply_chat_template`` (a later version may add some)."""
    try:
        from transformers import PreTrainedTokenizerBase
    except ImportError:  # pragma: no cover - transformers is a dependency
        return _RESERVED_TEMPLATE_KWARGS
    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.values()
    named = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}
    return _RESERVED_TEMPLATE_KWARGS | named


@dataclass
class PromptOptions:
    """How a request's prompt is rendered and tokenized (vLLM's defaults when not sent)."""

    add_special_tokens: bool | None = None  # None: vLLM's default, true for completions, false for chat
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: the context length
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks are shared only with the same salt
    # chat only
    chat_template: str | None = None  # the request's own template
    chat_template_kwargs: dict = field(default_factory=dict)
    documents: list[dict[str, str]] | None = None  # reaches the template as ``documents``
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def special_tokens_for(self, kind: str) -> bool:
        """Whether the tokenizer adds its special tokens (BOS ...): for chat, on top of those the
        template writes itself."""
        return self.add_special_tokens if self.add_special_tokens is not None else kind != "chat"


def _optional_bool(body: dict, name: str) -> bool | None:
    value = lax_bool(body.get(name))
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"`{name}` must be a boolean, got {type(value).__name__}", param=name)
    return value


def _truncate_prompt_tokens(body: dict) -> int | None:
    """vLLM: an integer >= 1 (keep the last k tokens) or -1 (keep the last max_model_len); 0 and
    anything below -1 are refused (vLLM's SamplingParams check). k > max_model_len is refused
    once the model is known (generation.py)."""
    k = body.get("truncate_prompt_tokens")
    if k is None:
        return None
    if not isinstance(k, int) or isinstance(k, bool) or not (k >= 1 or k == -1):
        raise bad_request(f"`truncate_prompt_tokens` must be an integer >= 1 or -1, got {k!r}",
                          param="truncate_prompt_tokens")
    return k


def _chat_template_kwargs(body: dict) -> dict:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise bad_request("`chat_template_kwargs` must be an object", param="chat_template_kwargs")
    clash = sorted(set(kwargs) & reserved_template_kwargs())
    if clash:
        raise bad_request(
            f"`chat_template_kwargs` cannot set {', '.join(repr(k) for k in clash)}: loraplex passes that to the chat "
            "template itself (send the request field of that name, where there is one: `tools`, `documents`, "
            "`add_generation_prompt`, `continue_final_message`, `chat_template`)",
            param="chat_template_kwargs",
        )
    return dict(kwargs)


def _documents(body: dict) -> list[dict[str, str]] | None:
    """vLLM's ``documents``: ``list[dict[str, str]]`` (its pydantic type), handed to
    ``apply_chat_template(documents=...)`` as sent. vLLM only recommends the keys ``title`` and
    ``text``, so any keys are taken; values must be strings (pydantic does not turn numbers into
    strings either). An empty list is passed on as one, as vLLM does: a template may tell it from
    none."""
    docs = body.get("documents")
    if docs is None:
        return None
    if not isinstance(docs, list):
        raise bad_request("`documents` must be a list of objects (e.g. {\"title\": ..., \"text\": ...})",
                          param="documents")
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict):
            raise bad_request(f"`documents[{i}]` must be an object of strings, got {type(doc).__name__}",
                              param="documents")
        bad = next((k for k, v in doc.items() if not isinstance(v, str)), None)
        if bad is not None:
            raise bad_request(f"`documents[{i}].{bad}` must be a string, got {type(doc[bad]).__name__}",
                              param="documents")
    return [dict(doc) for doc in docs]


def _cache_salt(body: dict) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad_request("`cache_salt` must be a non-empty string", param="cache_salt")
    return salt


def parse_prompt_options(body: dict, kind: str, messages: list[dict] | None = None) -> PromptOptions:
    """The prompt-side fields of a completions (``kind`` "completion") or chat request, checked;
    ``messages`` are the chat's parsed messages."""
    opts = PromptOptions(
        add_special_tokens=_optional_bool(body, "add_special_tokens"),
        truncate_prompt_tokens=_truncate_prompt_tokens(body),
        cache_salt=_cache_salt(body),
    )
    if kind != "chat":  # vLLM's CompletionRequest has none of the template fields
        return opts
    template = body.get("chat_template")
    if template is not None and (not isinstance(template, str) or not template.strip()):
        raise bad_request("`chat_template` must be a non-empty string (a Jinja template)", param="chat_template")
    opts.chat_template = template
    opts.chat_template_kwargs = _chat_template_kwargs(body)
    opts.documents = _documents(body)
    add_generation_prompt = _optional_bool(body, "add_generation_prompt")
    opts.add_generation_prompt = True if add_generation_prompt is None else add_generation_prompt
    opts.continue_final_message = bool(_optional_bool(body, "continue_final_message"))
    if opts.continue_final_message:
        # vLLM's check_generation_prompt (and transformers) refuse the pair; add_generation_prompt
        # defaults to true there too, so a continuation must turn it off explicitly
        if opts.add_generation_prompt:
            raise bad_request(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to true "
                "(`add_generation_prompt` defaults to true: send `\"add_generation_prompt\": false` to continue "
                "the final message).",
                param="continue_final_message",
            )
        if not messages or messages[-1]["role"] != "assistant":
            raise bad_request(
                "`continue_final_message` continues the final message, which must be the assistant's",
                param="continue_final_message",
            )
    return opts
