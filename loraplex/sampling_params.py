"""Per-request sampling options, with vLLM's names so callers can move over unchanged."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from loraplex.reasoning_boundary import ReasoningBoundary
    from loraplex.structured_output import StructuredOutputs

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for each logit_bias value: [-100, 100]


class InvalidRequestError(ValueError):
    """A request the engine refuses. ``param`` names the offending field (OpenAI's envelope)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass
class SamplingParams:
    """How to sample one request. ``temperature == 0`` means greedy."""

    n: int = 1
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0: only the chosen)
    # vLLM's prompt_logprobs: per prompt token (after the first), its logprob under the model,
    # its rank, and the top N; computed in full (such a request takes nothing from the prefix cache)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token id -> bias in [-100, 100] added to that token's logit before sampling (OpenAI's
    # logit_bias); ids are checked against the model's vocabulary when the engine takes the request
    logit_bias: dict[int, float] | None = None
    # vLLM's allowed_token_ids: sample only among these ids (greedy too)
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words: never generate these strings (as tokenized alone and after a space)
    bad_words: list[str] | None = None
    # bad_words as token id sequences, filled in by the engine with its tokenizer
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)
    # keep the output to a JSON schema / regex / choice / grammar (loraplex.structured_output)
    structured_outputs: "StructuredOutputs | None" = None
    # a reasoning model's end-of-reasoning tokens: structured_outputs holds only after them
    # (loraplex.reasoning_boundary); None: from the first token
    reasoning_boundary: "ReasoningBoundary | None" = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()
        if self.logit_bias is not None:  # normalised once: an empty bias is no bias
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()} or None

    @classmethod
    def from_kwargs(cls, **kwargs) -> "SamplingParams":
        """Build from keyword options; an unknown option is an error that names it."""
        names = {f.name for f in fields(cls)}
        for key in kwargs:
            if key not in names:
                raise InvalidRequestError(f"unknown sampling option {key!r}", param=key)
        return cls(**kwargs)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def bad(param: str, message: str) -> None:
            raise InvalidRequestError(message, param=param)

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "n must be an integer >= 1")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "max_tokens must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "min_tokens must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", "min_tokens must not exceed max_tokens")
        if not 0.0 <= as_float(self.temperature) <= 100.0:
            bad("temperature", "temperature must be in [0, 100]")
        if not 0.0 < as_float(self.top_p) <= 1.0:
            bad("top_p", "top_p must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "top_k must be -1, 0 (disabled) or a positive integer")
        if not 0.0 <= as_float(self.min_p) <= 1.0:
            bad("min_p", "min_p must be in [0, 1]")
        if not 0.0 < as_float(self.repetition_penalty) <= 10.0:
            bad("repetition_penalty", "repetition_penalty must be in (0, 10]")
        if not -2.0 <= as_float(self.presence_penalty) <= 2.0:
            bad("presence_penalty", "presence_penalty must be in [-2, 2]")
        if not -2.0 <= as_float(self.frequency_penalty) <= 2.0:
            bad("frequency_penalty", "frequency_penalty must be in [-2, 2]")
        # the upper bound is the engine's max_logprobs (check_logprobs_cap), not the params'
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            bad("logprobs", "logprobs must be an integer >= 0")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            bad("prompt_logprobs", "prompt_logprobs must be an integer >= 0")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "stop must be a non-empty string or a list of them")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "stop_token_ids must be non-negative integers")
        if self.logit_bias is not None:
            _check_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, list)
            or not self.allowed_token_ids
            or not all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)
        ):
            bad("allowed_token_ids", "allowed_token_ids must be a non-empty list of non-negative token ids")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list) or not all(isinstance(w, str) and w.strip() for w in self.bad_words)
        ):
            bad("bad_words", "bad_words must be a list of non-empty strings")
        if self.structured_outputs is not None:
            from loraplex.structured_output import StructuredOutputs

            if not isinstance(self.structured_outputs, StructuredOutputs):
                bad("structured_outputs", "structured_outputs must be a StructuredOutputs")
            self.structured_outputs.validate()
        if self.reasoning_boundary is not None:
            from loraplex.reasoning_boundary import ReasoningBoundary

            if not isinstance(self.reasoning_boundary, ReasoningBoundary):
                bad("reasoning_boundary", "reasoning_boundary must be a ReasoningBoundary")
            if self.structured_outputs is None:
                bad("reasoning_boundary", "reasoning_boundary says where structured_outputs starts; give one with it")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def as_float(v) -> float:
    """``float(v)``, or +-inf for an int no float holds (``10**400`` written out in JSON, where
    ``1e400`` reads as inf): such a value is then out of range, where ``float()`` raised
    OverflowError (a 500 on every route that reads or builds these params)."""
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


def _check_logit_bias(bias) -> None:
    if not isinstance(bias, dict):
        raise InvalidRequestError("logit_bias must be a mapping of token ids to biases", param="logit_bias")
    for token, value in bias.items():
        if not _is_int(token) or token < 0:
            raise InvalidRequestError(
                f"logit_bias keys must be non-negative token ids, got {token!r}", param="logit_bias"
            )
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(as_float(value)):
            raise InvalidRequestError(f"logit_bias[{token}] must be a number, got {value!r}", param="logit_bias")
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise InvalidRequestError(
                f"logit_bias[{token}] must be in [-100, 100], got {value}", param="logit_bias"
            )


def check_logprobs_cap(params: SamplingParams, max_logprobs: int, vocab_size: int) -> None:
    """vLLM's ``max_logprobs``: neither ``logprobs`` nor ``prompt_logprobs`` may ask for more
    alternatives per token; -1 lifts the cap to the vocabulary. vLLM's wording."""
    cap = vocab_size if max_logprobs == -1 else max_logprobs
    for param, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        wanted = getattr(params, param)
        if wanted is not None and wanted > cap:
            raise InvalidRequestError(
                f"Requested {kind} logprobs of {wanted}, which is greater than max allowed: {cap}", param=param)


def check_token_ids_in_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Token ids a request names must index the model's vocabulary (``logit_bias`` keys,
    ``allowed_token_ids``, ``reasoning_boundary``)."""
    if params.allowed_token_ids and max(params.allowed_token_ids) >= vocab_size:
        raise InvalidRequestError(
            f"allowed_token_ids names token id {max(params.allowed_token_ids)}, but the model's vocabulary "
            f"has {vocab_size} tokens (ids 0..{vocab_size - 1})",
            param="allowed_token_ids",
        )
    if params.reasoning_boundary is not None and max(params.reasoning_boundary.token_ids()) >= vocab_size:
        raise InvalidRequestError(
            f"reasoning_boundary names token id {max(params.reasoning_boundary.token_ids())}, but the model's "
            f"vocabulary has {vocab_size} tokens (ids 0..{vocab_size - 1})",
            param="reasoning_boundary",
        )
    if params.logit_bias:
        worst = max(params.logit_bias)
        if worst >= vocab_size:
            raise InvalidRequestError(
                f"logit_bias names token id {worst}, but the model's vocabulary has {vocab_size} tokens "
                f"(ids 0..{vocab_size - 1})",
                param="logit_bias",
            )
