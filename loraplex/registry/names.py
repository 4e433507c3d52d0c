"""Validation of tenant and adapter names, and parsing of ``name@version`` references.

Names end up in file paths, S3 keys, URLs and the OpenAI ``model`` field, so they use a small,
boring alphabet: lower-case ASCII letters and digits, ``-`` and ``_``; the first character is a
letter or digit; at most 63 characters (a DNS label). Upper case is refused rather than folded, so
that two names never differ only by case (case-insensitive file systems would merge them). Dots
are refused too, which rules out ``.``, ``..`` and hidden files in one go. Each rejection names
the rule that was broken.
"""

from __future__ import annotations

import re
import unicodedata

from loraplex.registry.errors import InvalidName

MAX_NAME_LENGTH = 63
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
VERSION_SEPARATOR = "@"
MAX_VERSION = 2**31 - 1  # fits the INTEGER column everywhere


def validate_name(name: object, kind: str = "name") -> str:
    """Return ``name`` unchanged when it is a valid tenant/adapter name; raise InvalidName otherwise."""
    if not isinstance(name, str):
        raise InvalidName(f"{kind} must be a string, got {type(name).__name__}")
    if not name:
        raise InvalidName(f"{kind} must not be empty")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidName(f"{kind} is {len(name)} characters long; the limit is {MAX_NAME_LENGTH}")
    for ch in name:
        if ch == "\x00" or unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp"):
            raise InvalidName(f"{kind} must not contain NUL or control characters (found {ch!r})")
    for ch in name:
        if ord(ch) > 127:
            raise InvalidName(
                f"{kind} must be plain ASCII (found {ch!r}, U+{ord(ch):04X} "
                f"{unicodedata.name(ch, 'unnamed')}); non-ASCII letters can impersonate ASCII ones"
            )
    if "/" in name or "\\" in name:
        raise InvalidName(f"{kind} must not contain a path separator ('/' or '\\')")
    if ".." in name or set(name) == {"."}:
        raise InvalidName(f"{kind} must not be '.', '..' or contain '..'")
    if "." in name:
        raise InvalidName(f"{kind} must not contain '.'")
    if name != name.lower():
        raise InvalidName(f"{kind} must be lower case ({name!r} has upper-case letters)")
    if not NAME_PATTERN.match(name):
        raise InvalidName(
            f"{kind} {name!r} is not allowed: use lower-case letters, digits, '-' and '_', "
            "starting with a letter or digit"
        )
    return name


def validate_tenant_name(name: object) -> str:
    return validate_name(name, "tenant name")


def validate_adapter_name(name: object) -> str:
    return validate_name(name, "adapter name")


def parse_model_ref(ref: object) -> tuple[str, int | None]:
    """Split ``"name"`` -> (name, None) and ``"name@3"`` -> (name, 3), validating both parts."""
    if not isinstance(ref, str):
        raise InvalidName(f"model reference must be a string, got {type(ref).__name__}")
    name, sep, version_text = ref.partition(VERSION_SEPARATOR)
    validate_adapter_name(name)
    if not sep:
        return name, None
    return name, parse_version(version_text)


def parse_version(text: object) -> int:
    """A version number: a positive decimal integer (``3``, ``"3"``); no signs, spaces or zero."""
    if isinstance(text, bool):
        raise InvalidName("version must be a positive integer")
    if isinstance(text, int):
        number = text
    elif isinstance(text, str) and text.isascii() and text.isdigit() and len(text) <= 9:
        number = int(text)
    else:
        raise InvalidName(f"version must be a positive integer, got {text!r}")
    if number < 1 or number > MAX_VERSION:
        raise InvalidName(f"version must be a positive integer of at most {MAX_VERSION}, got {text!r}")
    return number


def format_model_ref(name: str, version: int | None) -> str:
    return name if version is None else f"{name}{VERSION_SEPARATOR}{version}"
