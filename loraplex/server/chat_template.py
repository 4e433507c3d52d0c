"""vLLM's ``--chat-template``: the server's chat template in place of the tokenizer's (a model
without one, or one whose template a team replaced), as a file path or the template itself."""

from __future__ import annotations

from pathlib import Path

from jinja2 import TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

JINJA_CHARS = "{}\n"  # what tells a template from a path, as vLLM tells them apart


def load_chat_template(value: str) -> str:
    """The template text: the file's contents when ``value`` names a file, else ``value`` itself
    when it holds Jinja (escapes such as ``\\n`` decoded, for the single-line form vLLM takes).
    ValueError when it is neither, or does not compile, so a bad flag stops the server at start
    rather than failing every chat request."""
    path = Path(value).expanduser()
    if path.is_file():
        text = path.read_text(encoding="utf-8")
    elif any(c in value for c in JINJA_CHARS):
        text = _decode_escapes(value) if "\\" in value else value
    else:
        raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template")
    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).parse(text)
    except TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template: the template does not compile: {exc}") from None
    return text


def _decode_escapes(value: str) -> str:
    """``\\n``, ``\\t``, ``\\u00e9``... decoded, other text kept. vLLM's ``codecs.decode(value,
    "unicode_escape")`` reads the str's UTF-8 bytes as Latin-1, so "é" came out as "Ã©" once the
    template held any backslash; characters past Latin-1 are turned into ``\\uXXXX`` escapes first."""
    try:
        return value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as exc:  # a lone backslash at the end, a short \x or \u escape
        raise ValueError(f"--chat-template: a backslash escape does not decode: {exc.reason}") from None
