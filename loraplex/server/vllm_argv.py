"""A ``vllm serve`` command line's spelling, read as vLLM's argument parser reads it (vLLM's
FlexibleArgumentParser, vllm/utils/argparse_utils.py):

* a flag's name may use ``_`` for ``-`` (``--max_loras 4``, ``--gpu_memory_utilization=0.9``, as
  the vLLM production-stack Helm chart writes some of its flags); only the name before the first
  ``.`` is changed (``--speculative_config.num_speculative_tokens`` keeps its key), values never;
* a JSON flag may be given key by key: ``--compilation-config.level 3``,
  ``--speculative-config.method ngram``, ``--hf-overrides.rope_scaling.factor=2`` (each value read
  as JSON, else as a string; ``key+ a,b`` appends to a list), and ``-O.cudagraph_mode NONE`` and
  ``-cc.mode=0`` are ``--compilation-config``'s (``-cc`` is its short name, and so is ``-O
  '{...}'``; ``-O 3`` is the optimization level), ``-ac.backend FLASH_ATTN`` is
  ``--attention-config``'s. The keys of one flag are merged into one JSON
  object, passed after the other arguments as vLLM does (so a whole ``--flag '{...}'`` given too
  is replaced by it).

A dotted name whose flag is not known is left for argparse to report.
"""

from __future__ import annotations

import json
from collections.abc import Collection

# vLLM's -O.<key> and -cc.<key> are its --compilation-config's (``-cc.mode=0``), -ac.<key> its
# --attention-config's (``-ac.backend FLASH_ATTN``)
DOTTED_ALIASES = {"-O": "--compilation-config", "-cc": "--compilation-config", "-ac": "--attention-config"}


class FlagSyntaxError(ValueError):
    """A dotted flag that cannot be read (no value); the message names it."""


def dashed_flag_names(argv: list[str]) -> list[str]:
    """``argv`` with ``_`` in each ``--flag`` name (before any ``.key`` or ``=value``) turned into ``-``."""
    out = []
    for arg in argv:
        if arg.startswith("--"):
            name, sep, value = arg.partition("=")
            base, dot, keys = name.partition(".")
            arg = base.replace("_", "-") + dot + keys + sep + value
        out.append(arg)
    return out


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def merge_into(target: dict, update: dict) -> None:
    """``update`` merged into ``target``: mappings key by key, lists appended, anything else replaced."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            merge_into(target[key], value)
        elif isinstance(value, list) and isinstance(target.get(key), list):
            target[key] += value
        else:
            target[key] = value


def nested(keys: list[str], value) -> dict:
    """``["a", "b"], 1`` -> ``{"a": {"b": 1}}``; a last key ending in ``+`` makes ``value`` (a
    string) a list of its comma-separated items, to be appended."""
    if keys[-1].endswith("+"):
        keys = [*keys[:-1], keys[-1][:-1]]
        value = str(value).split(",")
    else:
        value = _value(value) if isinstance(value, str) else value
    out = value
    for key in reversed(keys):
        out = {key: out}
    return out


def _dotted_flag(arg: str, option_strings: Collection[str]) -> tuple[str, list[str], str | None] | None:
    """``(flag, keys, value after "=" or None)`` for a dotted argument of a known flag."""
    if not (arg.startswith("--") or arg.startswith(tuple(f"{alias}." for alias in DOTTED_ALIASES))):
        return None
    name, sep, value = arg.partition("=")
    base, dot, keys = name.partition(".")
    flag = DOTTED_ALIASES.get(base, base)
    if not dot or not keys or flag not in option_strings:
        return None
    return flag, keys.split("."), value if sep else None


def json_flag_groups(argv: list[str], option_strings: Collection[str]) -> list[str]:
    """``argv`` with vLLM's dotted JSON flags merged into one ``--flag '<JSON>'`` each, after the
    other arguments (see the module doc). Raises ``FlagSyntaxError`` for one without a value."""
    rest: list[str] = []
    groups: dict[str, dict] = {}
    i = 0
    while i < len(argv):
        if argv[i] == "-O" and i + 1 < len(argv) and argv[i + 1].lstrip().startswith("{"):
            rest += ["--compilation-config", argv[i + 1]]  # vLLM: -O with a JSON object is that flag
            i += 2
            continue
        found = _dotted_flag(argv[i], option_strings)
        if found is None:
            rest.append(argv[i])
            i += 1
            continue
        flag, keys, value = found
        if value is None:
            if i + 1 >= len(argv):
                raise FlagSyntaxError(f"{argv[i]}: expected a value")
            value = argv[i + 1]
            i += 1
        merge_into(groups.setdefault(flag, {}), nested(keys, value))
        i += 1
    for flag, value in groups.items():
        rest += [flag, json.dumps(value)]
    return rest
