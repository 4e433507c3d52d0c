"""``loraplex sglang-serve``: SGLang's launch_server flags (docs.sglang.io "Server Arguments")
through the entry point to the Settings and start-up flags ``serve`` would run with: each taken
flag lands on the loraplex setting that means the same, no-ops are logged, refusals name the
flag and what to use, an unknown flag is argparse's error with the closest flag."""

from __future__ import annotations

import json

import pytest

from loraplex.server.cli import settings_from_args
from loraplex.server.sglang_flags import TABLE
from loraplex.server.vllm_flags import VllmFlagError, startup_flags
from tests.server.cli_parsing import no_cli_env, parsed  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("no_cli_env")

# a launch line as SGLang's docs write one
LAUNCH = ["--model-path", "M", "--lora-paths", "a=/p", "b=/q", "--max-loras-per-batch", "8", "--max-lora-rank",
          "64", "--lora-target-modules", "all", "--port", "30000", "--context-length", "8192",
          "--max-running-requests", "256", "--chunked-prefill-size", "8192", "--disable-radix-cache",
          "--lora-backend", "triton", "--tp", "1", "--mem-fraction-static", "0.85"]


def test_the_port_defaults_to_sglangs(parsed, monkeypatch):
    """SGLang's launch_server listens on 30000 unless told (ServerArgs.port), and its clients and
    docs connect there; serve's 8000 stays for serve, and LORAPLEX_PORT or --port still win."""
    assert settings_from_args(parsed(["sglang-serve", "--model-path", "M"])).port == 30000
    assert settings_from_args(parsed(["sglang-serve", "--model-path", "M", "--port", "8080"])).port == 8080
    assert settings_from_args(parsed(["serve", "--model", "M"])).port == 8000
    monkeypatch.setenv("LORAPLEX_PORT", "9001")
    assert settings_from_args(parsed(["sglang-serve", "--model-path", "M"])).port == 9001


def test_sglang_lora_docs_lines_start(parsed, capsys):
    """docs.sglang.io "LoRA Serving" and "Server Arguments" flags that change no output: taken as
    logged no-ops (they were argparse's unknown-flag error, suggesting unrelated flags)."""
    args = parsed(["sglang-serve", "--model-path", "M", "--enable-lora", "--lora-paths", "lora0=/p",
                   "--lora-backend", "csgmv", "--max-lora-chunk-size", "16", "--lora-eviction-policy", "lru",
                   "--cuda-graph-bs", "1", "2", "4", "--page-size", "1", "--schedule-conservativeness", "1.3"])
    s = settings_from_args(args)
    assert (s.model, s.block_size) == ("M", 16)  # the page size leaves loraplex's block size
    out = capsys.readouterr().out
    for flag in ("--max-lora-chunk-size 16", "--lora-eviction-policy lru", "--cuda-graph-bs 1 2 4", "--page-size 1",
                 "--schedule-conservativeness 1.3"):
        assert flag in out


def test_a_launch_line_becomes_loraplex_settings(parsed, capsys):
    args = parsed(["sglang-serve", *LAUNCH, "--max-loras-per-batch", "4", "--max-lora-rank", "16"])
    s = settings_from_args(args)
    assert (s.model, s.port, s.max_model_len, s.max_num_seqs) == ("M", 30000, 8192, 256)
    assert (s.max_loras, s.max_lora_rank) == (4, 16)  # the last one given wins, as argparse does
    assert s.engine_config().gpu_memory_utilization == 0.85  # the GPU share of weights and KV cache
    assert (s.max_num_batched_tokens, s.enable_chunked_prefill, s.enable_prefix_caching) == (8192, True, False)
    flags = startup_flags(args, {})
    assert [(m.name, m.path) for m in flags.lora_modules] == [("a", "/p"), ("b", "/q")]
    out = capsys.readouterr().out
    assert "--lora-target-modules all" in out and "--lora-backend triton" in out  # the no-op lines


@pytest.mark.parametrize("argv, want", [
    (["--dtype", "half"], {"dtype": "float16"}),
    (["--dtype", "bfloat16"], {"dtype": "bfloat16"}),
    (["--random-seed", "7"], {"seed": 7}),
    (["--host", "0.0.0.0"], {"host": "0.0.0.0"}),
    (["--served-model-name", "m"], {"served_model_name": "m"}),
    (["--chunked-prefill-size", "-1"], {"enable_chunked_prefill": False}),
    (["--disable-cuda-graph"], {"cuda_graphs": False}),
    (["--schedule-policy", "fcfs"], {"scheduling_policy": "fcfs"}),
    (["--schedule-policy", "lpm"], {"scheduling_policy": "fair"}),  # order only: a logged no-op
    (["--max-loaded-loras", "12"], {"max_cpu_loras": 12}),
    (["--kv-cache-dtype", "fp8_e5m2"], {"kv_cache_dtype": "fp8_e5m2"}),
    (["--kv-cache-memory-fraction", "0.5"], {"kv_cache_memory_fraction": 0.5}),  # loraplex's own flag
    (["--mem-fraction-static", "0.45"], {"gpu_memory_utilization": 0.45}),
    (["--tool-call-parser", "qwen25"], {"tool_call_parser": "hermes"}),  # <tool_call>{json}</tool_call>
    (["--tool-call-parser", "llama3"], {"tool_call_parser": "llama3_json"}),
    (["--reasoning-parser", "deepseek-r1"], {"reasoning_parser": "deepseek_r1"}),
    (["--reasoning-parser", "qwen3"], {"reasoning_parser": "qwen3"}),
])
def test_each_taken_flag_lands_on_its_setting(parsed, argv, want):
    s = settings_from_args(parsed(["sglang-serve", "--model-path", "M", *argv]))
    assert {k: getattr(s, k) for k in want} == want


def test_api_key_and_json_lora_paths(parsed):
    item = json.dumps({"lora_name": "sql", "lora_path": "/a/sql", "pinned": True})
    flags = startup_flags(parsed(["sglang-serve", "--model-path", "M", "--api-key", "k1", "--lora-paths", item]), {})
    assert flags.api_keys == ("k1",) and [(m.name, m.path) for m in flags.lora_modules] == [("sql", "/a/sql")]


@pytest.mark.parametrize("argv, words", [
    (["--max-total-tokens", "100000"], ["--max-total-tokens", "--kv-cache-bytes"]),
    (["--is-embedding"], ["--is-embedding"]),
    (["--lora-paths", "/bare/path"], ["--lora-paths", "NAME=PATH"]),
    (["--nnodes", "2"], ["--nnodes"]),
    (["--speculative-algorithm", "EAGLE"], ["--speculative-algorithm", "--speculative-config"]),
    # values the table reads itself: a traceback (ValueError), not argparse's error
    (["--chunked-prefill-size", "8k"], ["--chunked-prefill-size", "8k", "integer"]),
    (["--nnodes", "two"], ["--nnodes", "two", "integer"]),
])
def test_refusals_name_the_flag(argv, words, capsys):
    from loraplex import cli

    assert cli.main(["sglang-serve", "--model-path", "M", *argv]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_more_than_one_device_is_refused_by_serves_rule(capsys):
    """serve's rule (vLLM's --tensor-parallel-size refusal), worded with the flag as given."""
    from loraplex import cli

    for flag in ("--tp", "--tp-size", "--tensor-parallel-size"):
        assert cli.main(["sglang-serve", "--model-path", "M", flag, "2"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("loraplex sglang-serve: error: ") and f"  {flag}: loraplex runs a model on one device" in err
        assert "vLLM" not in err and (flag == "--tensor-parallel-size" or "--tensor-parallel-size" not in err)
    with pytest.raises(VllmFlagError, match="--tensor-parallel-size"):  # serve's own flag: serve's words
        settings_from_args(cli_parser().parse_args(["serve", "--model", "M", "--tensor-parallel-size", "2"]))


@pytest.mark.parametrize("argv, flag, setting", [
    (["--mem-fraction-static", "1.5"], "--mem-fraction-static", "gpu_memory_utilization"),
    (["--mem-fraction-static", "0"], "--mem-fraction-static", "gpu_memory_utilization"),
    (["--context-length", "0"], "--context-length", "max_model_len"),
    (["--max-running-requests", "0"], "--max-running-requests", "max_num_seqs"),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size", "max_num_batched_tokens"),
    (["--max-loras-per-batch=0"], "--max-loras-per-batch", "max_loras"),
    (["--max-lora-rank", "0"], "--max-lora-rank", "max_lora_rank"),
    (["--max-loaded-loras", "2", "--max-loras-per-batch", "4"], "--max-loaded-loras", "max_cpu_loras"),
    (["--lora-paths", "a=/p", "a=/q"], "--lora-paths", "--lora-modules"),
])
def test_a_value_settings_refuse_names_the_sglang_flag(argv, flag, setting, capsys):
    """Values serve's Settings / EngineConfig checks refuse: the same rule as serve's (the same
    refusal for serve's own flag), but the error names the SGLang flag and this command, not
    serve's setting (`loraplex serve: error: ... gpu_memory_utilization`)."""
    from pydantic import ValidationError

    from loraplex import cli
    from loraplex.server.sglang_flags import translate

    serve_argv = translate(["--model-path", "M", *argv]).serve_argv
    with pytest.raises((ValidationError, VllmFlagError), match=setting):  # serve refuses it in its own words
        settings_from_args(cli_parser().parse_args(["serve", *serve_argv]))
        startup_flags(cli_parser().parse_args(["serve", *serve_argv]), {})
    assert cli.main(["sglang-serve", "--model-path", "M", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loraplex sglang-serve: error: ") and len(err.splitlines()) == 1, err
    assert flag in err and setting not in err, err


def test_a_default_in_the_message_is_named_by_its_sglang_flag(capsys):
    from loraplex import cli

    assert cli.main(["sglang-serve", "--model-path", "M", "--max-loaded-loras", "2"]) == 2
    assert "--max-loaded-loras (2) must be >= --max-loras-per-batch (8)" in capsys.readouterr().err
    # given by serve's own flag (passed on as it is): serve's name stays
    assert cli.main(["sglang-serve", "--model-path", "M", "--max-loaded-loras", "2", "--max-loras", "4"]) == 2
    assert "--max-loaded-loras (2) must be >= --max-loras (4)" in capsys.readouterr().err  # as typed


@pytest.mark.parametrize("argv, want", [
    (["--mem-fraction-static", "most"], "argument --mem-fraction-static: invalid float value: 'most'"),
    (["--max-loras-per-batch", "x"], "argument --max-loras-per-batch: invalid int value: 'x'"),
    (["--tp", "two"], "argument --tp: invalid int value: 'two'"),
    (["--lora-paths", "a="], "argument --lora-paths: 'a=': needs a non-empty name and path"),
])
def test_a_value_of_the_wrong_type_names_the_sglang_flag(argv, want, capsys):
    from loraplex import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["sglang-serve", "--model-path", "M", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"loraplex sglang-serve: error: {want}" in err, err


def cli_parser():
    from loraplex.cli import build_parser

    return build_parser()


def test_an_unknown_flag_gets_the_closest_one(capsys):
    from loraplex import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["sglang-serve", "--model-path", "M", "--max-loras-per-batc", "8"])
    assert exc.value.code == 2
    assert "did you mean --max-loras-per-batch?" in capsys.readouterr().err


def test_every_row_is_one_kind():
    for row in TABLE:
        assert (row.refuse is not None) + (row.to is not None or row.note is not None) == 1, row.names


def test_a_value_serve_refuses_is_argparses_error_under_this_command(capsys):
    from loraplex import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["sglang-serve", "--model-path", "M", "--tool-call-parser", "kimi_k2"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "loraplex sglang-serve: error: argument --tool-call-parser" in err
    assert len(err.splitlines()) == 2  # the short usage line and the error
