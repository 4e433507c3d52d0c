"""LongRoPE (``rope_type: longrope``, ``su`` in older Phi-3 configs): per-dimension rescaling of
the rotary frequencies with two factor lists, as Phi-3-mini-128k, Phi-3.5-mini and Phi-4-mini use.

transformers' ``_compute_longrope_parameters`` (5.x) divides each inverse frequency by its factor
(``1 / (factor_i * theta ** (2i / rotary_dim))``) and multiplies cos and sin by an attention
factor: the config's ``attention_factor``, else ``sqrt(1 + ln(factor) / ln(original))`` where
``factor`` is the config's or ``max_position_embeddings / original`` (1 when that is <= 1).

Which list applies: transformers switches the whole forward by its longest position (short while
``max(position) + 1 <= original``, long beyond), and its ``generate`` throws the KV cache away and
recomputes everything with the long list when a sequence first grows past ``original``. A paged
cache that keeps each token's K cannot do that, so loraplex picks per position: positions below
``original_max_position_embeddings`` rotate with ``short_factor``, positions at or beyond it with
``long_factor`` (vLLM keeps the same two tables, but switches a whole batch when any token in it
is past the original context). Consequences: a sequence that stays within the original context is
exactly transformers' (prompt and every decode step, also in a batch with long sequences); a
sequence that grows past it keeps its earlier keys on the short factors where transformers would
recompute them with the long ones. A token's K depends only on its position, never on its batch
mates, so prefix caching and batching stay exact.
"""

from __future__ import annotations

import math
from typing import Any

import torch


class LongRopeConfigError(ValueError):
    """The config's LongRoPE keys are missing or do not fit the model (wrapped by the caller)."""


def parse_longrope(
    cfg: dict[str, Any], params: dict[str, Any], rotary_dim: int
) -> tuple[dict[str, float], tuple[float, ...], tuple[float, ...]]:
    """``(scaling, short_factor, long_factor)`` from the rope dict ``params`` of config ``cfg``.

    ``scaling`` holds ``original_max_position_embeddings`` (the config's top-level key, which
    transformers' Phi-3 prefers, else the dict's),
    ``factor`` and ``attention_factor`` with transformers' defaults filled in."""
    factors = []
    for key in ("short_factor", "long_factor"):
        value = params.get(key)
        ok = isinstance(value, (list, tuple)) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in value
        )
        if not ok:
            raise LongRopeConfigError(f"longrope needs {key!r} as a list of positive numbers, got {value!r}")
        if len(value) != rotary_dim // 2:
            raise LongRopeConfigError(
                f"longrope {key!r} has {len(value)} entries; the rotary dimension {rotary_dim} needs {rotary_dim // 2}"
            )
        factors.append(tuple(float(v) for v in value))
    original = cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    if not isinstance(original, int) or original < 2:
        raise LongRopeConfigError(f"longrope needs original_max_position_embeddings (an int >= 2), got {original!r}")
    factor = params.get("factor") or cfg.get("max_position_embeddings", 2048) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    scaling = {
        "original_max_position_embeddings": original,
        "factor": float(factor),
        "attention_factor": float(attention_factor),
    }
    return scaling, factors[0], factors[1]


def longrope_inverse_frequencies(
    theta: float, factors: tuple[float, ...], rotary_dim: int
) -> torch.Tensor:  # [rotary_dim // 2] fp32
    """transformers' arithmetic, op for op, so the tables match bit for bit."""
    ext_factors = torch.tensor(factors, dtype=torch.float32)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (ext_factors * theta**exponents)


def longrope_angles(rope, rotary_dim: int, max_positions: int) -> torch.Tensor:  # [max_positions, rotary_dim // 2]
    """Rotation angle of every position and frequency: short factors below the original
    context, long factors from it on (see the module docstring)."""
    original = int(rope.scaling["original_max_position_embeddings"])
    positions = torch.arange(max_positions, dtype=torch.float32)
    short = torch.outer(positions, longrope_inverse_frequencies(rope.theta, rope.short_factor, rotary_dim))
    long = torch.outer(positions, longrope_inverse_frequencies(rope.theta, rope.long_factor, rotary_dim))
    return torch.where(positions[:, None] < original, short, long)
