"""A ``vllm serve`` command line on ``loraplex serve``: the Settings it gives against what each vLLM
flag means, and each flag loraplex refuses naming what to use instead."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from loraplex.cli import build_parser, main
from loraplex.config import Settings
from loraplex.server.cli import settings_from_args
from loraplex.server.vllm_flags import LoRAModule, VllmFlagError, startup_flags
from tests.server.cli_parsing import parsed  # noqa: F401  (fixture)


@pytest.fixture(autouse=True)
def _no_loraplex_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("LORAPLEX_") or name == "VLLM_ALLOW_RUNTIME_LORA_UPDATING":
            monkeypatch.delenv(name)


def settings(*argv: str) -> Settings:
    return settings_from_args(build_parser().parse_args(["serve", *argv]))


def test_a_typical_vllm_lora_command_line_runs_with_its_meaning():
    s = settings(
        "meta-llama/Llama-3.1-8B-Instruct", "--enable-lora", "--max-loras", "4", "--max-lora-rank", "32",
        "--max-cpu-loras", "16", "--served-model-name", "llama", "--host", "0.0.0.0", "--port", "8080",
        "--dtype", "bfloat16", "--seed", "7", "--max-model-len", "8192", "--max-num-seqs", "64",
        "--enable-prefix-caching", "--enforce-eager", "--tensor-parallel-size", "1",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    )
    assert s.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert (s.max_loras, s.max_lora_rank, s.max_cpu_loras, s.max_cpu_lora_bytes) == (4, 32, 16, None)
    assert (s.served_model_name, s.host, s.port, s.dtype, s.seed) == ("llama", "0.0.0.0", 8080, "bfloat16", 7)
    assert (s.max_model_len, s.max_num_seqs, s.enable_prefix_caching) == (8192, 64, True)
    assert s.cuda_graphs is False and s.tool_call_parser == "hermes"
    engine = s.engine_config()
    assert (engine.model, engine.max_cpu_loras, engine.max_lora_rank) == (s.model, 16, 32)


def test_the_positional_model_is_the_model_flag():
    assert settings("org/m").model == "org/m"
    assert settings("--port", "1", "org/m", "--max-loras", "2").model == "org/m"  # anywhere among flags
    assert settings("org/m", "--model", "org/m").model == "org/m"
    with pytest.raises(VllmFlagError, match=r"two models given: 'org/a' \(positional\) and --model 'org/b'"):
        settings("org/a", "--model", "org/b")


def test_enable_lora_changes_nothing():
    assert settings("m", "--enable-lora") == settings("m")


def test_auto_tool_choice_needs_a_parser_as_in_vllm(monkeypatch):
    with pytest.raises(VllmFlagError, match="^--enable-auto-tool-choice requires --tool-call-parser$"):
        settings("m", "--enable-auto-tool-choice")
    with_parser = settings("m", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json")
    assert with_parser.tool_call_parser == "llama3_json"
    monkeypatch.setenv("LORAPLEX_TOOL_CALL_PARSER", "hermes")  # a parser from the environment is a parser
    assert settings("m", "--enable-auto-tool-choice").tool_call_parser == "hermes"


def test_enforce_eager_turns_cuda_graphs_off(monkeypatch):
    monkeypatch.setenv("LORAPLEX_CUDA_GRAPHS", "true")
    assert settings("m").cuda_graphs is True
    assert settings("m", "--enforce-eager").cuda_graphs is False  # the flag wins over the environment
    with pytest.raises(VllmFlagError, match="--enforce-eager .* --cuda-graphs"):
        settings("m", "--enforce-eager", "--cuda-graphs")


def test_vllm_dtype_names_and_max_model_len_suffixes():
    assert [settings("--dtype", d).dtype for d in ("half", "float", "float16", "bfloat16", "float32", "auto")] == [
        "float16", "float32", "float16", "bfloat16", "float32", "auto"]
    # vLLM's human-readable lengths: lower case powers of 1000, upper case powers of 1024
    lens = {"4096": 4096, "32k": 32_000, "25.6k": 25_600, "32K": 32_768, "1M": 1 << 20, "1m": 1_000_000}
    for text, want in lens.items():
        assert settings("--max-model-len", text).max_model_len == want, text
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-model-len", "1.5K"])


def test_one_served_model_name_only():
    assert settings("m", "--served-model-name", "llama").served_model_name == "llama"
    with pytest.raises(VllmFlagError, match=r"one name, not 2 \(a, b\)"):
        settings("m", "--served-model-name", "a", "b")


# each refused vLLM flag, a value, and what its message must point to
REFUSED = [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size", "one replica per GPU"),
    (["-tp", "4"], "--tensor-parallel-size", "--device cuda:N"),
]


@pytest.mark.parametrize("argv,flag,instead", REFUSED, ids=[r[0][0] for r in REFUSED])
def test_each_refused_flag_names_what_to_use_instead(argv, flag, instead):
    with pytest.raises(VllmFlagError) as caught:
        settings("m", *argv)
    message = str(caught.value)
    assert f"{flag}: " in message and instead in message


def test_every_refused_flag_is_named_at_once_and_serve_exits_2(capsys):
    argv = ["serve", "m", "--lora-dtype", "float16", "-tp", "2", "--api-key", "sk-secret"]
    assert main(argv) == 2  # before anything is built or logged
    err = capsys.readouterr().err
    assert err.startswith("loraplex serve: error: ")
    assert all(f"\n  {flag}" in err for flag in ("--lora-dtype float16: ", "--tensor-parallel-size: "))
    assert "sk-secret" not in err  # an API key is never echoed back


@pytest.mark.parametrize("argv", [
    ["--gpu-memory-utilization", "0.45"], ["--gpu-memory-utilization=0.45"], ["--gpu_memory_utilization=0.45"],
    ["--gpu_memory_utilization", "0.45"],
])
def test_gpu_memory_utilization_is_taken_in_each_spelling(argv, parsed):
    # vLLM's FlexibleArgumentParser reads "_" in a flag's name as "-"; the value is vLLM's fraction
    args = parsed(["serve", "m", *argv])
    assert settings_from_args(args).engine_config().gpu_memory_utilization == 0.45


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2"])
def test_gpu_memory_utilization_outside_its_bounds_is_refused(value, capsys):
    assert main(["serve", "m", "--gpu-memory-utilization", value]) == 2  # vLLM's bounds: (0, 1]
    err = capsys.readouterr().err
    assert "--gpu-memory-utilization must be in (0, 1]" in err and f"not {float(value)}" in err


def test_a_kv_cache_size_given_beside_gpu_memory_utilization_sizes_the_cache():
    # vLLM: --kv-cache-memory-bytes wins over --gpu-memory-utilization (which stays valid)
    for size in (["--kv-cache-bytes", "1000000"], ["--kv-cache-memory-bytes", "1000000"]):
        config = settings("m", "--gpu-memory-utilization", "0.9", *size).engine_config()
        assert (config.kv_cache_bytes, config.gpu_memory_utilization) == (1000000, 0.9)


def test_host_cache_count_against_max_loras_and_bytes(capsys):
    with pytest.raises(ValidationError, match=r"max_cpu_loras \(2\) must be >= max_loras \(4\)"):
        settings("m", "--max-loras", "4", "--max-cpu-loras", "2")  # vLLM's rule and words
    assert settings("m", "--max-loras", "4", "--max-cpu-loras", "4").max_cpu_loras == 4
    with pytest.raises(ValidationError, match="both size the host cache: give one"):
        settings("m", "--max-cpu-loras", "16", "--max-cpu-lora-bytes", str(1 << 30))
    assert main(["serve", "m", "--max-cpu-loras", "1"]) == 2  # default max_loras is 8
    assert "--max-cpu-loras (1) must be >= --max-loras (8)" in capsys.readouterr().err  # in flag words


def test_a_byte_budget_from_the_environment_and_a_count_flag_are_refused_too(monkeypatch):
    monkeypatch.setenv("LORAPLEX_MAX_CPU_LORA_BYTES", str(4 << 30))
    assert settings("m").max_cpu_lora_bytes == 4 << 30
    with pytest.raises(ValidationError, match="give one"):
        settings("m", "--max-cpu-loras", "8")


def test_unknown_flags_are_still_argparse_errors(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--no-such-flag"])
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--max-num-batched-tokens", "--max-num-seqs", "--max-loras", "--max-lora-rank",
                                  "--block-size", "--max-model-len"])
def test_a_size_below_one_stops_serve_at_start(capsys, flag):
    """Taken before: ``--max-num-batched-tokens 0`` served, and every request waited for ever (no
    step could admit one); ``--block-size 0`` failed in the engine with ZeroDivisionError, and
    ``--max-num-seqs 0`` as a KV cache "too small"."""
    assert main(["serve", "m", flag, "0"]) == 2
    assert f"error: {flag}=0: must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["auto", "-1"])
def test_max_model_len_auto_is_the_default(monkeypatch, value):
    """vLLM's ``--max-model-len auto`` (or -1): the longest context the KV cache holds, which is
    loraplex's default. It was an argparse error ("invalid integer"), and -1 failed in the engine."""
    assert settings("m", "--max-model-len", value).max_model_len is None
    monkeypatch.setenv("LORAPLEX_MAX_MODEL_LEN", "2048")
    assert settings("m").max_model_len == 2048
    assert settings("m", "--max-model-len", value).max_model_len is None  # the flag wins


def serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_lora_modules_in_both_of_vllms_forms():
    """vLLM's ``name=path`` and its JSON form (``base_model_name`` optional), mixed, over one or
    several uses of the flag."""
    args = serve_args(
        "m", "--enable-lora", "--lora-modules", "sql=/adapters/sql", '{"name": "chat", "path": "/adapters/chat"}',
        "--lora-modules", '{"name": "tool", "path": "/a=b/tool", "base_model_name": "m"}', "eq=/p/with=sign",
    )
    flags = startup_flags(args)
    assert flags.lora_modules == (
        LoRAModule("sql", "/adapters/sql"), LoRAModule("chat", "/adapters/chat"),
        LoRAModule("tool", "/a=b/tool", "m"), LoRAModule("eq", "/p/with=sign"),
    )
    assert flags.api_keys == () and flags.given
    assert not startup_flags(serve_args("m")).given


def test_api_key_takes_one_or_more_keys_as_in_vllm():
    flags = startup_flags(serve_args("m", "--api-key", "sk-one", "sk-two", "--port", "9000", "--api-key", "lpx_x"))
    assert flags.api_keys == ("sk-one", "sk-two", "lpx_x")
    assert settings("m", "--api-key", "sk-one").port == 8000  # accepted: no longer refused


def test_vllms_api_key_variable_stands_for_the_flag():
    env = {"VLLM_API_KEY": "sk-from-env"}
    assert startup_flags(serve_args("m"), env).api_keys == ("sk-from-env",)
    assert startup_flags(serve_args("m", "--api-key", "sk-flag"), env).api_keys == ("sk-flag",)  # the flag wins
    assert startup_flags(serve_args("m"), {"VLLM_API_KEY": ""}).api_keys == ()
    assert startup_flags(serve_args("m")).api_keys == ()  # nothing read unless an environment is passed in


BAD_MODULES = [
    ("sql", "expected name=path or a JSON object"),
    ("=/adapters/sql", "needs a non-empty name and path"),
    ("sql=", "needs a non-empty name and path"),
    ("../up=/adapters/sql", "adapter name"),
    ('{"name": "sql", "path": "/a"', "invalid JSON"),
    ('{"name": "sql"}', "needs a non-empty name and path"),
    ('{"name": "sql", "path": "/a", "revision": "main"}', "unknown field(s) revision"),
    ('{"name": "sql", "path": "/a", "base_model_name": 3}', "base_model_name must be a string"),
    ('["sql", "/a"]', "expected name=path or a JSON object"),
]


@pytest.mark.parametrize("text,why", BAD_MODULES, ids=[b[0] for b in BAD_MODULES])
def test_a_malformed_lora_module_is_a_start_up_error(capsys, text, why):
    with pytest.raises(SystemExit) as caught:
        serve_args("m", "--lora-modules", text)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "argument --lora-modules:" in err and why in err


def test_a_module_name_given_twice_stops_serve(capsys):
    with pytest.raises(VllmFlagError, match="'sql' is given twice"):
        startup_flags(serve_args("m", "--lora-modules", "sql=/a", '{"name": "sql", "path": "/b"}'))
    assert main(["serve", "m", "--lora-modules", "sql=/a", "sql=/b"]) == 2
    assert "--lora-modules: 'sql' is given twice" in capsys.readouterr().err


def test_runtime_lora_updating_flag_roots_and_vllms_environment_variable(monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    assert settings("m").allow_runtime_lora_updating is False  # off by default
    s = settings("m", "--allow-runtime-lora-updating", "--lora-path-root", "/srv/a", "--lora-path-root", "/srv/b")
    assert s.allow_runtime_lora_updating is True and s.lora_path_roots == [Path("/srv/a"), Path("/srv/b")]
    for value, on in (("True", True), ("1", True), ("true", True), ("0", False), ("False", False)):
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
        assert settings("m").allow_runtime_lora_updating is on, value
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert settings("m", "--no-allow-runtime-lora-updating").allow_runtime_lora_updating is False  # the flag wins


def test_vllm_tenant_is_a_setting(monkeypatch):
    assert settings("m").vllm_tenant == "default"
    assert settings("m", "--vllm-tenant", "team-sql").vllm_tenant == "team-sql"
    monkeypatch.setenv("LORAPLEX_VLLM_TENANT", "from-env")
    assert settings("m").vllm_tenant == "from-env"


def test_a_model_path_read_as_an_api_key_is_refused(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    # `serve --api-key KEY ./model`: the model would be a second key and the default model served
    with pytest.raises(VllmFlagError, match=r"--api-key #2 names an existing path"):
        startup_flags(serve_args("--api-key", "sk-one", str(model)))
    with pytest.raises(VllmFlagError, match=r"--api-key #1"):
        startup_flags(serve_args("--api-key", "weights.gguf"))
    assert startup_flags(serve_args(str(model), "--api-key", "sk-one")).api_keys == ("sk-one",)  # model first


def test_chat_template_content_format_takes_vllms_values(capsys):
    assert settings("m").chat_template_content_format == "auto"  # vLLM's default
    for value in ("auto", "string", "openai"):
        assert settings("m", "--chat-template-content-format", value).chat_template_content_format == value
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--chat-template-content-format", "list"])
    assert "invalid choice" in capsys.readouterr().err
    run_batch = build_parser().parse_args(["run-batch", "-i", "a", "-o", "b", "--model", "m",
                                           "--chat-template-content-format", "string"])
    assert run_batch.chat_template_content_format == "string"
