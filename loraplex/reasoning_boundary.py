"""Where a reasoning model's output leaves its reasoning, for structured output that starts after it.

A thinking model (Qwen3, the DeepSeek-R1 distills) writes ``<think> ... </think>`` before its
answer. With a ``ReasoningBoundary`` in ``SamplingParams.reasoning_boundary``, the engine keeps
only the answer to ``structured_outputs``: the tokens up to and including the end marker are
sampled freely, and the grammar starts, fresh, with the token after it (vLLM does the same with
its reasoning parser's ``is_reasoning_end``). The markers are token id sequences, as the model's
tokenizer encodes them; the server builds the boundary from its ``--reasoning-parser`` and the
prompt (``loraplex.server.reasoning_parsers``), so the engine needs no tokenizer rules.

``starts_in`` says where the output begins:

- ``"reasoning"``: inside the reasoning (the prompt opened it, or the model always starts there
  as DeepSeek-R1 does): free until ``end_token_ids``.
- ``"content"``: in the answer (the prompt already closed the reasoning, as Qwen3's template does
  with thinking switched off): constrained from the first token, as without a boundary.
- ``"either"``: the model may open its reasoning with ``start_token_ids`` as its first tokens
  (Qwen3 with thinking on); any other first token is the answer's, so the grammar holds from it.

A model that never writes the end marker is never constrained: ``max_tokens`` (which counts the
reasoning tokens) ends it with ``length``, or it stops at EOS inside its reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.sampling_params import InvalidRequestError

STARTS = ("reasoning", "content", "either")


@dataclass(frozen=True)
class ReasoningBoundary:
    """The token ids that close (and open) a model's reasoning, and where the output starts."""

    end_token_ids: tuple[int, ...]  # e.g. the ids of "</think>"
    start_token_ids: tuple[int, ...] = ()  # e.g. the ids of "<think>"; needed for starts_in "either"
    starts_in: str = "reasoning"  # "reasoning" | "content" | "either"

    def __post_init__(self) -> None:
        # tuples whatever was passed, so the boundary compares and hashes by value
        object.__setattr__(self, "end_token_ids", _ids(self.end_token_ids, "end_token_ids", allow_empty=False))
        object.__setattr__(self, "start_token_ids", _ids(self.start_token_ids, "start_token_ids", allow_empty=True))
        if self.starts_in not in STARTS:
            _bad(f"starts_in must be one of {', '.join(STARTS)}, got {self.starts_in!r}")
        if self.starts_in == "either" and not self.start_token_ids:
            _bad('starts_in "either" needs start_token_ids (how the model opens its reasoning)')

    def token_ids(self) -> list[int]:
        """Every id named here (checked against the model's vocabulary by the engine)."""
        return [*self.end_token_ids, *self.start_token_ids]


def _bad(message: str) -> None:
    raise InvalidRequestError(f"reasoning_boundary: {message}", param="reasoning_boundary")


def _ids(value, name: str, allow_empty: bool) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        _bad(f"{name} must be a list of non-negative token ids")
    if not value and not allow_empty:
        _bad(f"{name} must not be empty")
    return tuple(value)
