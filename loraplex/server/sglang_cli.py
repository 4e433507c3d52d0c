"""``loraplex sglang-serve``: ``python -m sglang.launch_server``'s command line, served by
``loraplex serve``. SGLang's flags are read by the table in sglang_flags.py (taken, taken as a
no-op with a log line, or refused naming what to use); the ``serve`` command line they become is
parsed and checked as ``serve``'s own, so every value is held to the same rules; an error about
a value names the SGLang flag it was given with, under this command's name."""

from __future__ import annotations

import argparse
import os
import re
import sys

from loraplex.server import sglang_flags

COMMAND = "sglang-serve"
SGLANG_PORT = 30000  # ServerArgs.port in sglang's server_args.py: where SGLang clients and scripts connect


def add_parser(subparsers) -> None:
    """Registered for ``loraplex --help``; ``loraplex.cli.main`` hands its arguments to ``main``."""
    p = subparsers.add_parser(COMMAND, help="serve with SGLang's launch_server flags (--model-path, --lora-paths ...)",
                              add_help=False)
    p.add_argument("sglang_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda args: main(args.sglang_args))


def help_text() -> str:
    lines = [f"usage: loraplex {COMMAND} --model-path M [SGLang flags] [loraplex serve flags]", "",
             __doc__, "", "SGLang flags:"]
    for row in sglang_flags.TABLE:
        if row.refuse:
            what = f"refused: {row.refuse}"
        elif row.to is None:
            what = f"no-op: {row.note}"
        else:
            sample = True if row.nargs == "0" else ["N=P"] if row.nargs == "+" else "V"
            try:
                what = "loraplex serve " + (" ".join(row.to(sample)) or "(nothing)")
            except (ValueError, TypeError):
                what = "checked, then taken"
            if row.note:
                what += f"; else no-op: {row.note}"
        lines.append(f"  {', '.join(row.names)}: {what}")
    return "\n".join(lines)


def serve_args(argv: list[str], environ=os.environ) -> tuple[argparse.Namespace, list[str]]:
    """``(serve's parsed arguments, the no-op notes)``; raises ``SGLangFlagError`` for a refused
    flag or a value serve's settings refuse, exits as argparse does (status 2, the closest known
    flag) for an unknown one or a value of the wrong type. Without ``--port`` (or
    ``LORAPLEX_PORT``) the server listens on SGLang's port, not ``serve``'s."""
    from loraplex.cli import build_parser
    from loraplex.server import vllm_flags
    from loraplex.server.cli import settings_error_message, settings_from_args

    translation = sglang_flags.translate(argv)
    top = build_parser()
    serve = top._subparsers._group_actions[0].choices["serve"]
    names = serve_names(serve, translation.given_as, argv)
    # argparse's errors on a value name this command (with a short usage line) and the SGLang flag
    serve.prog, serve.usage = f"loraplex {COMMAND}", f"loraplex {COMMAND} --model-path M [flags] (--help lists them)"
    argparse_error = serve.error
    serve.error = lambda message: argparse_error(in_sglang_words(message, names))
    args, unknown = top.parse_known_args(["serve", *translation.serve_argv])
    if unknown:
        serve.error(sglang_flags.unknown_message(unknown, serve._option_string_actions))
    if args.port is None and "LORAPLEX_PORT" not in environ:
        args.port = SGLANG_PORT
    # serve's own errors (what it checks before it starts: the model, the TLS files ...; then a
    # --lora-paths adapter it cannot register) name this command and the SGLang flags too
    args.serve_command, args.serve_words = COMMAND, lambda message: in_sglang_words(message, names)
    # checked here as serve checks them (again) when it starts, so that an error names the SGLang flag
    try:
        settings_from_args(args)
        vllm_flags.startup_flags(args, environ)
    except Exception as exc:
        message = settings_error_message(exc, args)
        if message is None:
            raise
        raise sglang_flags.SGLangFlagError(in_sglang_words(message, names)) from None
    return args, translation.notes


def serve_names(serve: argparse.ArgumentParser, given_as: dict[str, str], argv: list[str]) -> dict[str, str]:
    """Each name serve's errors give a value that came from a SGLang flag (its option strings as
    argparse joins them, the flag, the setting it fills) -> that SGLang flag as given. A setting
    left at its default is named by the SGLang flag that sets it ("--max-loaded-loras (1) must be
    >= --max-loras-per-batch (8)"); one given by serve's own flag keeps serve's name."""
    actions = serve._option_string_actions
    defaults = {flag: sglang for flag, sglang in sglang_flags.serve_flags_of_values().items()
                if flag in actions and not any(a == o or a.startswith(o + "=")
                                               for o in actions[flag].option_strings for a in argv)}
    names = {}
    for flag, sglang in {**defaults, **given_as}.items():
        action = actions.get(flag)
        if action is None:
            continue
        names["/".join(action.option_strings)] = names[flag] = sglang
        for setting in (action.dest, action.dest.removeprefix("vllm_")):
            if "_" in setting:  # an identifier, never a word of the message's prose ("model", "seed")
                names[setting] = sglang
    return names


def in_sglang_words(message: str, names: dict[str, str]) -> str:
    """``message`` with every name of ``names`` (a whole flag or identifier) replaced."""
    message = message.replace("vLLM flag(s) loraplex does not take", "flag(s) loraplex does not take")
    if not names:
        return message
    alternatives = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    return re.sub(rf"(?<![\w-])({alternatives})(?![\w-])", lambda m: names[m.group(1)], message)


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(help_text())
        return 0
    try:
        args, notes = serve_args(argv)
    except sglang_flags.SGLangFlagError as exc:
        print(f"loraplex {COMMAND}: error: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"loraplex: SGLang flag taken as a no-op: {note}", flush=True)
    return int(args.func(args) or 0)
