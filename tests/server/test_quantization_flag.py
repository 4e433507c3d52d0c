"""``--quantization`` is a loraplex setting under vLLM's name (``LORAPLEX_QUANTIZATION``, the
engine's ``quantization``): "fp8" quantizes an unquantized checkpoint at load; an FP8 checkpoint
is served as fp8 without it. Any other value (awq, gptq, ...) stops the start with status 2
naming the setting, before anything is built."""

from __future__ import annotations


import pytest

from loraplex.cli import build_parser, main
from loraplex.server.cli import settings_from_args
from tests.server.cli_parsing import no_cli_env  # noqa: F401 (a fixture)


pytestmark = pytest.mark.usefixtures("no_cli_env")


def test_fp8_reaches_the_engine_config():
    settings = settings_from_args(build_parser().parse_args(["serve", "m", "--quantization", "fp8"]))
    assert settings.quantization == "fp8" and settings.engine_config().quantization == "fp8"
    assert settings_from_args(build_parser().parse_args(["serve", "m"])).engine_config().quantization is None
    short = settings_from_args(build_parser().parse_args(["serve", "m", "-q", "fp8"]))  # vLLM's short form
    assert short.quantization == "fp8"


@pytest.mark.parametrize("value", ["awq", "gptq", "bitsandbytes"])
def test_another_method_stops_serve_naming_it(tmp_path, monkeypatch, capsys, value):
    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path / "home"))
    assert main(["serve", "m", "--quantization", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loraplex serve: error: ") and f"quantization={value!r} is not served" in err
    assert not (tmp_path / "home").exists()  # no registry, no model: nothing started
