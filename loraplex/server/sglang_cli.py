"""``loraplex sglang-serve``: ``python -m sglang.launch_server``'s command line, served by
``loraplex serve``. SGLang's flags are read by the table in sglang_flags.py (taken, taken as a
no-op with a log line, or refused naming what to use); the ``serve`` command line they become is
parsed and checked as ``serve``'s own, so every value is held to the same rules."""

from __future__ import annotations

import argparse
import os
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
    flag, exits as argparse does (status 2, the closest known flag) for an unknown one. Without
    ``--port`` (or ``LORAPLEX_PORT``) the server listens on SGLang's port, not ``serve``'s."""
    from loraplex.cli import build_parser

    translation = sglang_flags.translate(argv)
    top = build_parser()
    serve = top._subparsers._group_actions[0].choices["serve"]
    # argparse's errors on a value name this command, with a short usage line
    serve.prog, serve.usage = f"loraplex {COMMAND}", f"loraplex {COMMAND} --model-path M [flags] (--help lists them)"
    args, unknown = top.parse_known_args(["serve", *translation.serve_argv])
    if unknown:
        serve.error(sglang_flags.unknown_message(unknown, serve._option_string_actions))
    if args.port is None and "LORAPLEX_PORT" not in environ:
        args.port = SGLANG_PORT
    return args, translation.notes


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
