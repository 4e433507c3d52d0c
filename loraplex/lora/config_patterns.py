"""The regular expressions an adapter's config brings, matched with a time limit.

PEFT reads ``target_modules`` and ``exclude_modules`` (as strings), ``layers_pattern`` and the
keys of ``rank_pattern`` / ``alpha_pattern`` as regular expressions and matches them against
module names. An uploader chooses them: a pattern that backtracks without bound (``(.*)(.*)...x``)
held Python's ``re`` (and the GIL) for minutes on a single module name, stalling every request of
every tenant. Here they are matched by the ``regex`` module, which speaks ``re``'s syntax, lets
other threads run while it matches (``concurrent``) and gives up after ``MATCH_TIMEOUT_SECONDS``:
the adapter is then refused, naming the pattern. A module name is tens of characters; a pattern
PEFT users write matches it in microseconds.
"""

from __future__ import annotations

import re

import regex

from loraplex.lora.errors import InvalidAdapterError

MATCH_TIMEOUT_SECONDS = 0.05


def _too_slow(what: str, pattern: str) -> InvalidAdapterError:
    return InvalidAdapterError(
        f"adapter_config.json: {what} {pattern[:200]!r} takes too long to match a module name (a regular "
        "expression that backtracks without bound); write it without nested or repeated wildcards"
    )


def check_compiles(what: str, pattern: str, shown: str | None = None) -> None:
    """``InvalidAdapterError`` unless ``pattern`` is a regular expression both PEFT (``re``) and
    this module read; ``shown``: the config's own pattern, where ``pattern`` is what PEFT builds
    around it."""
    where = "" if shown is None else " inside the pattern PEFT builds around it"
    for module in (re, regex):
        try:
            module.compile(pattern)
        except module.error as exc:
            raise InvalidAdapterError(
                f"adapter_config.json: {what} {shown or pattern!r} is not a valid regular expression{where} ({exc})"
            ) from None


def fullmatch(what: str, pattern: str, name: str) -> bool:
    """``re.fullmatch(pattern, name)``, refused (``InvalidAdapterError``) when it takes too long."""
    try:
        return regex.fullmatch(pattern, name, concurrent=True, timeout=MATCH_TIMEOUT_SECONDS) is not None
    except TimeoutError:
        raise _too_slow(what, pattern) from None


def match(what: str, pattern: str, shown: str, name: str) -> regex.Match | None:
    """``re.match(pattern, name)``, refused when it takes too long; ``shown`` is the config's
    own pattern that ``pattern`` is built around (what the refusal names)."""
    try:
        return regex.match(pattern, name, concurrent=True, timeout=MATCH_TIMEOUT_SECONDS)
    except TimeoutError:
        raise _too_slow(what, shown) from None
