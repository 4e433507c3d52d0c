"""The ``loraplex`` command. Each area adds its own subcommands; this file only wires them.

Settings are built here, once, and passed down.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (module, description) of each subcommand group; each module has ``add_parser(subparsers)``
# which registers its subcommand(s) with ``set_defaults(func=callable(args) -> int)``.
SUBCOMMAND_MODULES = (
    "loraplex.server.cli",  # serve
    "loraplex.server.batch_cli",  # run-batch
    "loraplex.server.sglang_cli",  # sglang-serve
    "loraplex.registry.cli",  # adapters, tenants
    "loraplex.registry.usage_cli",  # usage
    "loraplex.engine.cli",  # generate (offline demo)
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex", description="Multi-LoRA serving")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sglang-serve"]:  # SGLang's flags, its own table (loraplex/server/sglang_flags.py)
        from loraplex.server.sglang_cli import main as sglang_serve

        return sglang_serve(argv[1:])
    choices = parser._subparsers._group_actions[0].choices
    command = choices.get(argv[0]) if argv else None
    if argv[:1] in (["serve"], ["run-batch"]):
        # vLLM's `--flag_name` spellings, dotted JSON flags and `--config FILE.yaml`
        from loraplex.server.vllm_argv import FlagSyntaxError, dashed_flag_names, json_flag_groups
        from loraplex.server.vllm_config_file import ConfigFileError, expand

        try:
            argv = [argv[0], *json_flag_groups(dashed_flag_names(argv[1:]), command._option_string_actions)]
            argv = expand(argv, command)
        except (ConfigFileError, FlagSyntaxError) as exc:
            command.error(str(exc))  # argparse's way: usage, the message, exit status 2
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse's error, with the closest known flags
        from loraplex.flag_suggestions import unrecognized_message

        (command or parser).error(unrecognized_message(unknown, (command or parser)._option_string_actions))
    return int(args.func(args) or 0)

if __name__ == "__main__":
    sys.exit(main())
