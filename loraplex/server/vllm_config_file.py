"""vLLM's ``serve --config FILE.yaml`` (and ``run-batch --config``: vLLM parses both commands with
its FlexibleArgumentParser): flags read from a YAML mapping of long flag names to values, with the
command line winning, as vLLM's argument parser does it.

Each entry becomes flags inserted right after ``serve`` (and after a positional model), so a flag
also given on the command line is read later and wins: ``key: true`` is ``--key``, ``key: false``
is ``--no-key`` where that flag exists (else nothing), a list is ``--key item ...``, a mapping is
``--key '<JSON>'`` and anything else ``--key str(value)``. ``model: M`` yields to a model on the
command line, and a list flag (``--api-key``, ``--lora-modules``) given on the command line
replaces the file's list, as vLLM's ``nargs="+"`` flags do (loraplex's add up, so a key rotated on
the command line would otherwise leave the file's old key served). Keys may
use ``_`` for ``-``. A nested mapping is the flag's JSON (``speculative-config: {method: ngram,
num_speculative_tokens: 4}``), and dotted keys are vLLM's dotted flags (``compilation-config.level:
3``, ``speculative-config.method: ngram``), merged into that flag's JSON (after a mapping given
under the flag's own key), as vLLM reads ``--compilation-config.level 3`` (vLLM itself passes a
nested mapping on as Python's repr, which its JSON flags cannot read). Where vLLM leaves an
unknown key to argparse ("unrecognized arguments"), this names the key and the file; every
error exits with status 2 before anything starts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from loraplex.server.vllm_argv import merge_into, nested

CONFIG_FLAG = "--config"


class ConfigFileError(ValueError):
    """The config file cannot be read as ``serve`` flags; the message says why."""


def config_path(argv: list[str]) -> tuple[str, list[str]] | None:
    """``(path, argv without --config PATH)``, or None when no ``--config`` is given."""
    found = [i for i, arg in enumerate(argv) if arg == CONFIG_FLAG or arg.startswith(CONFIG_FLAG + "=")]
    if not found:
        return None
    if len(found) > 1:
        raise ConfigFileError("--config is given more than once: give one file")
    i = found[0]
    if argv[i] != CONFIG_FLAG:
        return argv[i].split("=", 1)[1], argv[:i] + argv[i + 1:]
    if i + 1 >= len(argv):
        raise ConfigFileError("--config needs a file: --config FILE.yaml")
    return argv[i + 1], argv[:i] + argv[i + 2:]


def read_entries(path: str) -> dict:
    """The file's top-level mapping; a file that is missing, not ``.yaml``/``.yml`` (as vLLM
    requires) or not a mapping is a ``ConfigFileError``."""
    import yaml

    if Path(path).suffix not in (".yaml", ".yml"):
        raise ConfigFileError(f"--config {path}: the file must be YAML (.yaml or .yml), as in vLLM")
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigFileError(f"--config {path}: cannot read it ({exc.strerror})") from None
    try:
        entries = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"--config {path}: not valid YAML ({exc})") from None
    if entries is None:
        return {}
    if not isinstance(entries, dict):
        raise ConfigFileError(f"--config {path}: expected a mapping of flag names to values")
    return entries


def _flag_name(key) -> str:
    """A file key's flag: ``_`` read as ``-`` in the name (not in the keys after a ``.``)."""
    base, dot, keys = str(key).partition(".")
    return "--" + base.replace("_", "-") + dot + keys


def fold_dotted_keys(entries: dict, path: str) -> dict:
    """``entries`` with each dotted key (``compilation-config.level: 3``) merged into its flag's
    mapping, in the place of the flag's own key if it has one."""
    out: dict = {}
    names: dict[str, object] = {}  # flag -> its key in ``out``
    for key, value in entries.items():
        flag, dot, keys = _flag_name(key).partition(".")
        if not dot:
            names.setdefault(flag, key)
            out[key] = value
            continue
        if not keys:
            raise ConfigFileError(f"--config {path}: {key}: a key is missing after the '.'")
        target = names.setdefault(flag, flag[2:])
        current = out.get(target, {})
        if isinstance(current, str):  # the flag's JSON as a string
            try:
                current = json.loads(current)
            except json.JSONDecodeError:
                current = None
        if not isinstance(current, dict):
            raise ConfigFileError(f"--config {path}: {key}: {target} is not a mapping to add {keys} to")
        merge_into(current, nested(keys.split("."), value))
        out[target] = current
    return out


def entries_to_args(entries: dict, path: str, options: dict[str, argparse.Action], command: str = "serve") -> list[str]:
    """The flags ``entries`` stand for, each checked against ``options`` (the option strings of
    ``loraplex command``)."""
    out: list[str] = []
    for key, value in entries.items():
        flag = _flag_name(key)
        if flag not in options or flag == CONFIG_FLAG:
            raise ConfigFileError(f"--config {path}: unknown key {key!r}: no `loraplex {command}` flag {flag} "
                                  f"(see `loraplex {command} --help`)")
        if value is None:
            raise ConfigFileError(f"--config {path}: {key}: null; give a value or leave the key out")
        if isinstance(value, bool):
            if value:
                out.append(flag)
            elif f"--no-{flag[2:]}" in options:
                out.append(f"--no-{flag[2:]}")
        elif isinstance(value, list):
            if value:  # vLLM's --lora-modules JSON form may be a mapping in the list
                out += [flag, *(json.dumps(item) if isinstance(item, dict) else str(item) for item in value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def _given_on_command_line(key, given: argparse.Namespace, parser: argparse.ArgumentParser) -> bool:
    """Whether the command line (parsed as ``given``) sets what file key ``key`` would, for the
    keys whose file value would not simply be overridden by a later flag: ``model`` (also the
    positional) and the multi-valued flags, which add up in loraplex where vLLM's ``nargs="+"``
    lets the last use replace the others."""
    if key == "model":
        return getattr(given, "model_tag", None) is not None or given.model is not None
    action = parser._option_string_actions.get("--" + str(key).replace("_", "-"))
    if action is None or not isinstance(action, (argparse._AppendAction, argparse._ExtendAction)):
        return False
    return getattr(given, action.dest, None) != action.default


def _parse_command_line(parser: argparse.ArgumentParser, rest: list[str]) -> argparse.Namespace:
    """What ``rest`` alone sets, with required flags (run-batch's ``-i`` / ``-o``) let off: the
    file may be what gives them."""
    required = [action for action in parser._actions if action.required]
    for action in required:
        action.required = False
    try:
        return parser.parse_known_args(rest)[0]
    finally:
        for action in required:
            action.required = True


def expand(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` (starting with the command, ``serve`` or ``run-batch``; ``parser`` is its
    subparser) with its ``--config`` file's flags in place of ``--config FILE``, placed so that
    the command line wins."""
    command = argv[0]
    found = config_path(argv[1:])
    if found is None:
        return argv
    path, rest = found
    entries = fold_dotted_keys(read_entries(path), path)
    if entries:
        given = _parse_command_line(parser, rest)
        entries = {k: v for k, v in entries.items() if not _given_on_command_line(k, given, parser)}
    config_args = entries_to_args(entries, path, parser._option_string_actions, command)
    # after a leading positional model (vLLM's place), before every other command-line flag
    head = 1 if rest and not rest[0].startswith("-") else 0
    return [command, *rest[:head], *config_args, *rest[head:]]
