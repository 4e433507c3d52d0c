"""Fixtures for the tests of how ``loraplex serve`` and ``run-batch`` read their flags (vLLM's
included): a test module imports them (``from tests.server.cli_parsing import parsed``) and
marks itself ``pytestmark = pytest.mark.usefixtures("no_cli_env")``."""

from __future__ import annotations

import os

import pytest

from loraplex import cli as loraplex_cli


@pytest.fixture
def no_cli_env(monkeypatch):
    """No ``LORAPLEX_*`` / ``VLLM_*`` variable of the machine running the tests reaches the parse."""
    for name in list(os.environ):
        if name.startswith("LORAPLEX_") or name.startswith("VLLM_"):
            monkeypatch.delenv(name)


@pytest.fixture
def parsed(monkeypatch):
    """What ``loraplex COMMAND ...`` (serve or run-batch) parses to through the entry point,
    without running it."""
    seen = {}

    def run(argv: list[str]):
        parser = loraplex_cli.build_parser()
        for command in ("serve", "run-batch"):
            parser._subparsers._group_actions[0].choices[command].set_defaults(
                func=lambda args: seen.__setitem__("args", args))
        monkeypatch.setattr(loraplex_cli, "build_parser", lambda: parser)
        assert loraplex_cli.main(argv) == 0
        return seen["args"]

    return run
