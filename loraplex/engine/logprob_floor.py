"""Logprobs as they are reported: finite numbers, so that every API can write them as JSON.

A row whose logits are not finite (an adapter whose update overflows, a model that overflows in
half precision) has NaN log-probabilities, and a token the model rules out has -inf. Neither is
a JSON number: a whole answer with one failed to encode (HTTP 500) and a stream wrote ``NaN``,
which no JSON parser reads. Both become ``LOGPROB_FLOOR``, the floor vLLM's OpenAI server puts
under -inf (``max(logprob, -9999.0)``): "as unlikely as can be said".
"""

from __future__ import annotations

import torch

LOGPROB_FLOOR = -9999.0


def reportable(logprobs: torch.Tensor) -> torch.Tensor:
    """``logprobs`` with NaN and -inf as ``LOGPROB_FLOOR`` (and +inf, which no log-softmax
    gives, as 0)."""
    return logprobs.nan_to_num(nan=LOGPROB_FLOOR, posinf=0.0, neginf=LOGPROB_FLOOR)
