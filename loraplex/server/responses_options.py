"""The Responses API's output options: ``include``, ``top_logprobs`` and ``truncation``.

``include`` takes the items vLLM's ``ResponsesRequest`` takes (its ``Literal`` list):

- ``"message.output_text.logprobs"``: each ``output_text`` part carries ``logprobs`` (vLLM's and
  OpenAI's shape, chat completions' ``logprobs.content`` entries: ``{token, logprob, bytes,
  top_logprobs: [{token, logprob, bytes}]}``), ``top_logprobs`` alternatives per token (0-20,
  or the server's ``--max-logprobs``, as chat's ``top_logprobs``); ``top_logprobs`` without it
  asks for nothing (vLLM and OpenAI ignore it the same way), but a bad value is still a 400.
- ``"reasoning.encrypted_content"``: accepted; nothing is encrypted here, a reasoning item's text
  is in its ``content``, which ``input`` reads back (vLLM accepts it the same way).
- ``"code_interpreter_call.outputs"``, ``"computer_call_output.output.image_url"``,
  ``"file_search_call.results"``, ``"message.input_image.image_url"``: accepted, and there is
  never anything to add, as the built-in tools and images they name are refused (vLLM accepts them).

OpenAI's ``web_search_call.*`` items (not in vLLM's list) and anything else are 400s naming them.

``truncation: "auto"`` follows vLLM (``truncate_prompt_tokens=-1`` with ``max_output_tokens``
reserved, vllm-project/vllm#38132): the rendered prompt keeps its last tokens, as many as the
context leaves after ``max_output_tokens``, instead of a 400. OpenAI drops whole input items from
the start instead; vLLM cuts tokens, so the kept text may start mid-message (the system message
goes first). Where ``max_output_tokens`` is not sent vLLM reserves nothing and then refuses the
prompt that fills the context; here the prompt keeps the most the server admits (one token short
of the context, or ``--max-prompt-tokens``) and the answer gets what is left.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.server.body_fields import read_int
from loraplex.server.errors import bad_request
from loraplex.server.limits import max_prompt_len
from loraplex.server.sampling_fields import logprobs_cap

LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = (
    LOGPROBS, "reasoning.encrypted_content", "code_interpreter_call.outputs",
    "computer_call_output.output.image_url", "file_search_call.results", "message.input_image.image_url",
)
_NOT_SERVED = {  # OpenAI's, not vLLM's: what they would add comes from a tool this server does not run
    "web_search_call.results": "web search is a built-in tool this server does not run",
    "web_search_call.action.sources": "web search is a built-in tool this server does not run",
}
TRUNCATIONS = ("auto", "disabled")


@dataclass
class OutputOptions:
    """What the request asks of the output, read from a Responses body."""

    logprobs: bool = False  # include has "message.output_text.logprobs"
    top_logprobs: int = 0
    truncation: str = "disabled"


def parse_output_options(body: dict, max_logprobs: int) -> OutputOptions:
    include = body.get("include")
    if include is None:
        include = []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise bad_request("`include` must be a list of strings", param="include")
    for item in include:
        if item in _NOT_SERVED:
            raise bad_request(f"`include`: {item!r} is not served ({_NOT_SERVED[item]}).", param="include",
                              code="unsupported_parameter")
        if item not in INCLUDABLE:
            raise bad_request(f"`include`: unknown item {item!r} (served: {', '.join(INCLUDABLE)}).",
                              param="include")
    top = read_int(body, "top_logprobs", None, lo=0, hi=logprobs_cap(max_logprobs))
    truncation = body.get("truncation")
    if truncation is None:
        truncation = "disabled"
    if truncation not in TRUNCATIONS:
        raise bad_request('`truncation` must be "auto" or "disabled"', param="truncation")
    return OutputOptions(logprobs=LOGPROBS in include, top_logprobs=top or 0, truncation=truncation)


def auto_truncation_keep(max_model_len: int, max_prompt_tokens: int | None, max_output_tokens: int | None,
                         truncate_prompt_tokens: int | None) -> int:
    """The prompt tokens ``truncation: "auto"`` keeps (the last ones): what the context leaves
    after ``max_output_tokens``, at most what the server admits, and no more than a
    ``truncate_prompt_tokens`` sent too (-1: the context). At least 1: a ``max_output_tokens``
    that fills the context is then refused by the context check, naming it."""
    keep = max_prompt_len(max_model_len, max_prompt_tokens)
    if max_output_tokens is not None:
        keep = min(keep, max_model_len - max_output_tokens)
    if truncate_prompt_tokens is not None and truncate_prompt_tokens != -1:
        keep = min(keep, truncate_prompt_tokens)
    return max(keep, 1)
