"""vLLM's ``serve --config FILE.yaml`` on ``loraplex serve``: the file's keys are flags, the command
line wins (vLLM's documented order: command line > config file > defaults), and a key that is no
flag, a file that is not YAML or cannot be read stops the start with status 2 naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex import cli as loraplex_cli
from loraplex.config import Settings
from loraplex.server.cli import settings_from_args
from loraplex.server.vllm_config_file import expand
from loraplex.server.vllm_flags import LoRAModule, startup_flags
from tests.server.cli_parsing import no_cli_env, parsed  # noqa: F401 (fixtures)


pytestmark = pytest.mark.usefixtures("no_cli_env")


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def settings_of(args) -> Settings:
    return settings_from_args(args)  # as run_serve makes them


CONFIG = """\
model: /models/from-config
max-loras: 4
max_lora_rank: 32          # underscores are read as dashes, as in vLLM
port: 9001
dtype: half
max-model-len: 32k
enable-prefix-caching: false
enforce-eager: true
kv-cache-dtype: auto
lora-modules:
  - sql=/adapters/sql
  - {"name": "chat", "path": "/adapters/chat"}
api-key: [sk-one, sk-two]
"""


def test_the_files_values_are_applied(tmp_path, parsed):
    args = parsed(["serve", "--config", write(tmp_path, CONFIG)])
    s = settings_of(args)
    assert (s.model, s.max_loras, s.max_lora_rank, s.port, s.dtype) == ("/models/from-config", 4, 32, 9001, "float16")
    assert (s.max_model_len, s.enable_prefix_caching, s.cuda_graphs) == (32_000, False, False)
    flags = startup_flags(args)
    assert flags.lora_modules == (LoRAModule("sql", "/adapters/sql"), LoRAModule("chat", "/adapters/chat"))
    assert flags.api_keys == ("sk-one", "sk-two")


def test_the_command_line_wins_over_the_file(tmp_path, parsed):
    path = write(tmp_path, CONFIG)
    args = parsed(["serve", "/models/cli", "--config", path, "--max-loras", "2", "--enable-prefix-caching"])
    s = settings_of(args)
    assert (s.model, s.max_loras, s.enable_prefix_caching) == ("/models/cli", 2, True)
    assert s.max_lora_rank == 32  # what the command line leaves alone comes from the file
    # --model on the command line wins too, wherever --config stands
    assert settings_of(parsed(["serve", "--config", path, "--model", "/models/flag"])).model == "/models/flag"
    assert settings_of(parsed(["serve", "--max-loras=3", f"--config={path}"])).max_loras == 3


def test_false_is_the_no_flag_where_one_exists_and_nothing_else(tmp_path, parsed):
    s = settings_of(parsed(["serve", "m", "--config", write(tmp_path, "enable-chunked-prefill: false\n"
                                                                    "trust-remote-code: false\n")]))
    assert s.enable_chunked_prefill is False


@pytest.mark.parametrize("text,why", [
    ("max-loras: 4\nno-such-flag: 1\n", "unknown key 'no-such-flag': no `loraplex serve` flag --no-such-flag"),
    ("- max-loras\n", "expected a mapping of flag names to values"),
    ("max-loras: [1\n", "not valid YAML"),
    ("max-loras: null\n", "max-loras: null"),
    ("config: other.yaml\n", "unknown key 'config'"),
])
def test_a_bad_file_stops_serve_with_status_2(tmp_path, capsys, text, why):
    path = write(tmp_path, text)
    with pytest.raises(SystemExit) as caught:
        loraplex_cli.main(["serve", "--config", path])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "loraplex serve: error: --config " in err and why in err


def test_only_yaml_files_and_one_of_them(tmp_path, capsys):
    for argv, why in [
        (["serve", "--config", write(tmp_path, "max-loras: 4\n", "c.json")], "must be YAML (.yaml or .yml)"),
        (["serve", "--config", str(tmp_path / "missing.yaml")], "cannot read it"),
        (["serve", "--config", write(tmp_path, "{}"), "--config", write(tmp_path, "{}", "b.yml")], "more than once"),
        (["serve", "--config"], "needs a file"),
    ]:
        with pytest.raises(SystemExit) as caught:
            loraplex_cli.main(argv)
        assert caught.value.code == 2 and why in capsys.readouterr().err


def test_a_refused_flag_in_the_file_is_refused_as_on_the_command_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path / "home"))
    path = write(tmp_path, "lora-dtype: float16\ntensor-parallel-size: 2\n")
    assert loraplex_cli.main(["serve", "m", "--config", path]) == 2
    err = capsys.readouterr().err
    assert "\n  --lora-dtype float16: " in err and "\n  --tensor-parallel-size: " in err
    assert not (tmp_path / "home").exists()


def test_expand_places_the_files_flags_after_a_leading_model(tmp_path):
    serve = loraplex_cli.build_parser()._subparsers._group_actions[0].choices["serve"]
    path = write(tmp_path, "max-loras: 4\n")
    assert expand(["serve", "m", "--config", path, "--port", "1"], serve) == [
        "serve", "m", "--max-loras", "4", "--port", "1"]
    assert expand(["serve", "--port", "1"], serve) == ["serve", "--port", "1"]


def test_a_list_flag_on_the_command_line_replaces_the_files_list(tmp_path, parsed):
    """vLLM's list flags are ``nargs="+"`` (arg_utils makes one from a ``list[...]`` field), so a
    later use replaces an earlier one and the command line's ``--api-key`` / ``--lora-modules``
    win over the file's: a key rotated on the command line leaves the file's old key revoked,
    not served beside the new one. A list the command line leaves alone comes from the file."""
    path = write(tmp_path, CONFIG)
    flags = startup_flags(parsed(["serve", "--config", path, "--api-key", "sk-new"]))
    assert flags.api_keys == ("sk-new",)
    assert flags.lora_modules == (LoRAModule("sql", "/adapters/sql"), LoRAModule("chat", "/adapters/chat"))
    flags = startup_flags(parsed(["serve", "--config", path, "--lora-modules=other=/adapters/other"]))
    assert flags.lora_modules == (LoRAModule("other", "/adapters/other"),)
    assert flags.api_keys == ("sk-one", "sk-two")
    # repeating the flag on the command line still adds up there (loraplex's own reading)
    flags = startup_flags(parsed(["serve", "--config", path, "--api-key", "a", "--api-key", "b"]))
    assert flags.api_keys == ("a", "b")


def test_run_batch_reads_config_files_and_underscored_flags_as_vllm_run_batch_does(tmp_path, parsed, capsys):
    """``vllm run-batch`` parses with vLLM's FlexibleArgumentParser as ``serve`` does: ``--config
    FILE.yaml`` (the input and output files may be in it) and ``--flag_name`` spellings."""
    path = write(tmp_path, "input_file: in.jsonl\noutput-file: out.jsonl\nmax-model-len: 2k\n"
                           "lora-modules: [sql=/adapters/sql]\nenforce-eager: true\n")
    args = parsed(["run-batch", "--config", path, "--model", "/models/m", "--max_model_len", "1k"])
    assert (args.input_file, args.output_file, args.model) == ("in.jsonl", "out.jsonl", "/models/m")
    assert args.max_model_len == 1000  # the command line wins
    assert args.lora_modules == ["sql=/adapters/sql"] and args.enforce_eager
    args = parsed(["run-batch", "--config", path, "--lora-modules", "b=/b"])
    assert args.lora_modules == ["b=/b"]  # replaces the file's list, as vLLM's nargs="+"
    with pytest.raises(SystemExit) as caught:
        loraplex_cli.main(["run-batch", "--config", write(tmp_path, "no-such-flag: 1\n")])
    assert caught.value.code == 2
    assert "loraplex run-batch: error: --config " in capsys.readouterr().err
