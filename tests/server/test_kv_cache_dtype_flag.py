"""``--kv-cache-dtype`` is a loraplex setting under vLLM's name and values (auto, bfloat16, float16,
fp8, fp8_e4m3, fp8_e5m2) on ``serve`` and ``run-batch``, in a vLLM config file and as
``LORAPLEX_KV_CACHE_DTYPE``; any other value stops the start with status 2 naming the flag and the
values, before anything is built (vLLM's own flag rejects an unknown value the same way,
argparse's choices). vLLM's fp8_inc and fp8_ds_mla (its CacheDType) are refused by what they are."""

from __future__ import annotations


import pytest

from loraplex.cli import build_parser, main
from loraplex.config import EngineConfig
from loraplex.server.cli import settings_from_args
from tests.server.cli_parsing import no_cli_env  # noqa: F401 (a fixture)


pytestmark = pytest.mark.usefixtures("no_cli_env")


@pytest.mark.parametrize("command", ["serve", "run-batch"])
@pytest.mark.parametrize("value", ["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"])
def test_each_vllm_value_reaches_the_engine_config(command, value):
    argv = [command, "m"] if command == "serve" else [command, "-i", "in.jsonl", "-o", "out.jsonl", "--model", "m"]
    settings = settings_from_args(build_parser().parse_args([*argv, "--kv-cache-dtype", value]))
    assert settings.kv_cache_dtype == value
    assert settings.engine_config().kv_cache_dtype == value


def test_the_default_is_auto():
    assert settings_from_args(build_parser().parse_args(["serve", "m"])).engine_config().kv_cache_dtype == "auto"


def test_a_vllm_config_file_sets_it(tmp_path):
    path = tmp_path / "vllm.yaml"
    path.write_text("kv-cache-dtype: fp8_e5m2\n")
    from loraplex.server.vllm_config_file import expand

    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # as loraplex.cli.main expands it
    argv = expand(["serve", "m", "--config", str(path)], serve)
    assert settings_from_args(parser.parse_args(argv)).kv_cache_dtype == "fp8_e5m2"


def test_an_unknown_value_stops_serve_naming_the_choices(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path / "home"))
    with pytest.raises(SystemExit) as caught:
        main(["serve", "m", "--kv-cache-dtype", "int8"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "argument --kv-cache-dtype: invalid choice: 'int8'" in err
    assert all(v in err for v in ("'auto'", "'fp8'", "'fp8_e4m3'", "'fp8_e5m2'"))
    assert not (tmp_path / "home").exists()  # no registry, no model: nothing started


def test_an_unknown_value_from_the_environment_stops_serve(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("LORAPLEX_KV_CACHE_DTYPE", "int8")
    assert main(["serve", "m"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loraplex serve: error: LORAPLEX_KV_CACHE_DTYPE: ") and "'fp8_e5m2'" in err
    assert not (tmp_path / "home").exists()


@pytest.mark.parametrize("value", ["int8", "fp16", "FP8", ""])
def test_engine_config_and_llm_refuse_an_unknown_value(value, tmp_path):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, float16, fp8, fp8_e4m3, "
                                         "fp8_e5m2, not"):
        EngineConfig(kv_cache_dtype=value)
    from loraplex.engine.llm import LLM

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):  # before any model is looked for
        LLM(model=str(tmp_path / "no-such-model"), kv_cache_dtype=value)


# vLLM's CacheDType values loraplex does not serve, and what the refusal must call them
UNSERVED = {"fp8_inc": "Intel Gaudi", "fp8_ds_mla": "DeepSeek's packed fp8 layout of an MLA latent cache"}


@pytest.mark.parametrize("value", sorted(UNSERVED))
def test_vllms_unserved_values_are_refused_by_what_they_are(value, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path / "home"))
    with pytest.raises(SystemExit) as caught:
        main(["serve", "m", "--kv-cache-dtype", value])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --kv-cache-dtype: kv_cache_dtype {value} is {UNSERVED[value]}" in err
    assert "invalid choice" not in err and "use one of auto, bfloat16, float16, fp8" in err
    monkeypatch.setenv("LORAPLEX_KV_CACHE_DTYPE", value)
    assert main(["serve", "m"]) == 2
    assert UNSERVED[value] in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"kv_cache_dtype {value} is {UNSERVED[value]}"):
        EngineConfig(kv_cache_dtype=value)
    assert not (tmp_path / "home").exists()
