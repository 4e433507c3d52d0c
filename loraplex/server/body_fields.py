"""Typed readers of a JSON request body's fields: a field left out or null is the default; one
of the wrong type or out of range is a 400 whose ``param`` names it (errors.py). Shared by the
OpenAI (protocol.py), TGI (tgi_protocol.py) and tokenizer request parsers."""

from __future__ import annotations

import math

from loraplex.sampling_params import as_float
from loraplex.server.errors import bad_request


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _typed(body: dict, name: str, check, kind: str, default=None, lax=None):
    """``body[name]`` if ``check`` takes it (after ``lax``, the value it stands for), the
    default when left out or null, else a 400 naming it."""
    value = body.get(name)
    if lax is not None:
        value = lax(value)
    if value is None:
        return default
    if not check(value):
        raise bad_request(f"`{name}` must be {kind}, got {type(value).__name__}", param=name)
    return value


def lax_int(value):
    """``value``, or the integer a float with no fractional part stands for (``4.0``, what
    Python's ``budget / 2`` sends): vLLM's request models (pydantic, lax) take it so."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


def lax_bool(value):
    """``value``, or the boolean 0 or 1 stands for (chat's ``logprobs: 1``), as pydantic's lax
    booleans take them."""
    if is_int(value) and value in (0, 1):
        return bool(value)
    return value


def read_int(body, name, default=None, lo=None, hi=None):
    """An integer (not a boolean; a float with no fractional part counts) in ``[lo, hi]`` where
    given."""
    v = _typed(body, name, is_int, "an integer", default, lax=lax_int)
    _check_range(name, v, lo, hi)
    return v


def read_number(body, name, default=None, lo=None, hi=None):
    """A finite integer or float (not a boolean) in ``[lo, hi]`` where given, as a float. The
    request parser reads ``NaN`` and ``Infinity`` (as Python's json does), and NaN passes every
    range comparison."""
    v = _typed(body, name, is_number, "a number", default)
    if isinstance(v, float) and not math.isfinite(v):  # (an int is finite, and may not fit a float)
        raise bad_request(f"`{name}` must be a finite number, got {v}", param=name)
    _check_range(name, v, lo, hi)
    return as_float(v) if v is not None else None


def read_str(body, name, default=None):
    return _typed(body, name, lambda v: isinstance(v, str), "a string", default)


def read_bool(body, name, default=False):
    """A boolean (0 and 1 count)."""
    return _typed(body, name, lambda v: isinstance(v, bool), "a boolean", default, lax=lax_bool)


def _check_range(name, v, lo, hi) -> None:
    if v is None:
        return
    if lo is not None and v < lo:
        raise bad_request(f"`{name}` must be >= {lo}, got {v}", param=name)
    if hi is not None and v > hi:
        raise bad_request(f"`{name}` must be <= {hi}, got {v}", param=name)


def read_int_list(body, name) -> list[int]:
    """A list of non-negative integers (token ids); [] when left out."""
    v = body.get(name)
    if v is None:
        return []
    if not isinstance(v, list) or not all(is_int(t) and t >= 0 for t in v):
        raise bad_request(f"`{name}` must be a list of non-negative integers", param=name)
    return v
