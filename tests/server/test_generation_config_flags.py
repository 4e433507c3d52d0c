"""``loraplex serve --generation-config`` / ``--override-generation-config`` (vLLM's flags, and
``LORAPLEX_*`` settings): taken as given, and a bad one stops serve at start, exit status 2 with
a message naming it, before anything is built."""

from __future__ import annotations

import os

import pytest

from loraplex.cli import build_parser, main
from loraplex.server.cli import settings_from_args


@pytest.fixture(autouse=True)
def _no_loraplex_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("LORAPLEX_"):
            monkeypatch.delenv(name)


def test_the_flags_become_settings(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6}')
    args = build_parser().parse_args(["serve", "m", "--generation-config", str(tmp_path),
                                      "--override-generation-config", '{"top_k": 5}'])
    s = settings_from_args(args)
    assert (s.generation_config, s.override_generation_config) == (str(tmp_path), '{"top_k": 5}')
    assert s.engine_config().generation_config == str(tmp_path)
    assert s.engine_config().override_generation_config == '{"top_k": 5}'
    default = settings_from_args(build_parser().parse_args(["serve", "m"]))
    assert (default.generation_config, default.override_generation_config) == ("auto", None)  # vLLM's default


@pytest.mark.parametrize("argv, words", [
    (["--override-generation-config", "{temperature: 0.5}"], "not valid JSON"),
    (["--override-generation-config", '{"temprature": 0.5}'], "unknown field(s) 'temprature'"),
    (["--override-generation-config", '{"top_p": 1.5}'], "top_p=1.5"),
    (["--generation-config", "/no/such/folder"], "no generation_config.json there"),
])
def test_a_bad_option_stops_serve_at_start(capsys, argv, words):
    assert main(["serve", "m", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loraplex serve: error: ") and words in err


def test_the_environment_is_checked_too(monkeypatch, capsys):
    monkeypatch.setenv("LORAPLEX_OVERRIDE_GENERATION_CONFIG", '{"max_new_tokens": -3}')
    assert main(["serve", "m"]) == 2
    assert "max_new_tokens=-3" in capsys.readouterr().err
