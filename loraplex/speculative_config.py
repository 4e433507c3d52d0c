"""vLLM's ``speculative_config`` (``--speculative-config JSON``), n-gram method only.

Field names are vLLM's (https://docs.vllm.ai/en/latest/features/speculative_decoding/n_gram/):
``method``, ``num_speculative_tokens``, ``prompt_lookup_max``, ``prompt_lookup_min``. As in
vLLM, when only one of the lookup bounds is given the other takes its value; when neither is,
both are ``DEFAULT_PROMPT_LOOKUP`` (vLLM's SpeculativeConfig uses 5 then). Every other method
(draft models, EAGLE, MTP, ...) needs a second model and is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

DEFAULT_PROMPT_LOOKUP = 5
KNOWN_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


class SpeculativeConfigError(ValueError):
    """A ``speculative_config`` loraplex cannot run (the message says why)."""


@dataclass(frozen=True)
class NgramSpeculation:
    """Prompt-lookup drafting: up to ``num_speculative_tokens`` tokens copied from after the
    latest earlier occurrence of the last n tokens, n from ``prompt_lookup_max`` down to
    ``prompt_lookup_min``."""

    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int


def _positive_int(config: dict, name: str) -> int | None:
    value = config.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpeculativeConfigError(f"speculative_config: {name} must be an integer >= 1, not {value!r}")
    return value


def parse_speculative_config(value: dict | str | None) -> NgramSpeculation | None:
    """A JSON object (string) or dict -> the n-gram settings; None or ``{}`` -> off."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise SpeculativeConfigError(f"speculative_config is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise SpeculativeConfigError("speculative_config must be a JSON object")
    if not value:
        return None
    method = value.get("method")
    if method != "ngram":
        raise SpeculativeConfigError(
            f"speculative_config: method {method!r} is not supported; loraplex runs only \"ngram\" "
            "(prompt lookup, no draft model)")
    unknown = sorted(set(value) - set(KNOWN_FIELDS))
    if unknown:
        raise SpeculativeConfigError(f"speculative_config: unsupported field(s) for ngram: {', '.join(unknown)}")
    k = _positive_int(value, "num_speculative_tokens")
    if k is None:
        raise SpeculativeConfigError("speculative_config: num_speculative_tokens is required")
    hi = _positive_int(value, "prompt_lookup_max")
    lo = _positive_int(value, "prompt_lookup_min")
    if hi is None and lo is None:
        hi = lo = DEFAULT_PROMPT_LOOKUP
    hi = lo if hi is None else hi
    lo = hi if lo is None else lo
    if lo > hi:
        raise SpeculativeConfigError(
            f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
    return NgramSpeculation(num_speculative_tokens=k, prompt_lookup_max=hi, prompt_lookup_min=lo)
