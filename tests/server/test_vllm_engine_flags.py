"""vLLM's engine flags on ``loraplex serve`` (loraplex/server/vllm_engine_flags.py): a value that
means what loraplex does is taken and changes no setting (the Settings equal those without it),
any other stops the start naming the flag and loraplex's way, with exit status 2 and nothing
built. The reference is each flag's meaning in vLLM's engine arguments."""

from __future__ import annotations

import json

import pytest

from loraplex.cli import build_parser, main
from loraplex.config import Settings
from loraplex.server import vllm_engine_flags
from loraplex.server.cli import settings_from_args
from loraplex.server.vllm_flags import VllmFlagError
from tests.server.cli_parsing import no_cli_env  # noqa: F401 (a fixture)
from tests.fixtures.tiny_models import make_tiny_model_dir


pytestmark = pytest.mark.usefixtures("no_cli_env")


def settings(*argv: str) -> Settings:
    return settings_from_args(build_parser().parse_args(["serve", *argv]))


def notes(*argv: str) -> list[str]:
    return vllm_engine_flags.notes(build_parser().parse_args(["serve", *argv]))


# vLLM flags whose value asks for what loraplex does anyway: (argv, the start-up note's flag)
NO_OPS = [
    (["--tokenizer-mode", "auto"], "--tokenizer-mode"),
    (["--pipeline-parallel-size", "1"], "--pipeline-parallel-size"),
    (["-pp", "1"], "--pipeline-parallel-size"),
    (["--data-parallel-size", "1"], "--data-parallel-size"),
    (["--max-seq-len-to-capture", "8192"], "--max-seq-len-to-capture"),
    (["--lora-dtype", "auto"], "--lora-dtype"),
    (["--max-parallel-loading-workers", "2"], "--max-parallel-loading-workers"),
    (["--swap-space", "16"], "--swap-space"),
    (["--enable-log-requests"], "--enable-log-requests"),
    (["--task", "generate"], "--task"),
    (["--runner", "generate"], "--runner"),
    (["-O3"], "-O"),
    (["-O", "0"], "-O"),
    (["--compilation-config", '{"level": 3, "cudagraph_capture_sizes": [1, 2, 4]}'], "--compilation-config"),
    (["--load-format", "safetensors"], "--load-format"),
    (["--limit-mm-per-prompt", '{"image": 0, "video": 0}'], "--limit-mm-per-prompt"),
    (["--limit-mm-per-prompt", "image=0"], "--limit-mm-per-prompt"),
    (["--fully-sharded-loras"], "--fully-sharded-loras"),
    (["--disable-custom-all-reduce"], "--disable-custom-all-reduce"),
    (["--distributed-executor-backend", "mp"], "--distributed-executor-backend"),
    (["--disable-frontend-multiprocessing"], "--disable-frontend-multiprocessing"),
    (["--cpu-offload-gb", "0"], "--cpu-offload-gb"),
    (["--guided-decoding-backend", "guidance"], "--guided-decoding-backend"),
    (["--structured-outputs-config", '{"backend": "guidance"}'], "--structured-outputs-config"),
    (["--enable-reasoning", "--reasoning-parser", "qwen3"], "--enable-reasoning"),
    (["--cuda-graph-sizes", "1", "2", "4", "8"], "--cuda-graph-sizes"),
    (["--api-server-count", "1"], "--api-server-count"),
]


@pytest.mark.parametrize("argv,flag", NO_OPS, ids=[" ".join(a) for a, _ in NO_OPS])
def test_a_value_that_means_what_loraplex_does_is_taken_and_noted(argv, flag):
    rest = ["--reasoning-parser", "qwen3"] if "--reasoning-parser" in argv else []
    assert settings("m", *argv) == settings("m", *rest)
    assert [n for n in notes("m", *argv) if n.startswith(flag)], notes("m", *argv)


def test_async_scheduling_is_overlap_outputs_and_schedule_ahead():
    """vLLM's --async-scheduling (the host's share of a step overlapping the next one's device
    work) sets loraplex's two options for it either way; a contradicting one is refused."""
    assert settings("m").overlap_outputs is None  # the engine's default: on where it overlaps (CUDA)
    assert settings("m", "--async-scheduling").overlap_outputs is True
    assert settings("m", "--no-async-scheduling").overlap_outputs is False
    # and the step ahead, which is what vLLM's flag names
    assert settings("m").schedule_ahead is False
    assert settings("m", "--async-scheduling").engine_config().schedule_ahead is True
    assert settings("m", "--no-async-scheduling").schedule_ahead is False
    with pytest.raises(VllmFlagError, match=r"--\[no-\]schedule-ahead disagree"):
        settings("m", "--async-scheduling", "--no-schedule-ahead")
    assert settings("m", "--async-scheduling", "--overlap-outputs").engine_config().overlap_outputs is True
    assert [n for n in notes("m", "--async-scheduling") if n.startswith("--async-scheduling: taken as --overlap")]
    assert notes("m", "--no-async-scheduling") == []
    with pytest.raises(VllmFlagError, match="disagree"):
        settings("m", "--async-scheduling", "--no-overlap-outputs")


def test_vllms_boolean_optional_forms_turn_the_engine_options_off():
    s = settings("m", "--no-enable-prefix-caching", "--no-enable-chunked-prefill")
    assert (s.enable_prefix_caching, s.enable_chunked_prefill) == (False, False)
    assert (s.engine_config().enable_prefix_caching, s.engine_config().enable_chunked_prefill) == (False, False)


def test_a_command_line_without_these_flags_logs_no_notes():
    assert notes("m", "--max-loras", "4") == []
    # vLLM's --no- forms of its switches ask for nothing either
    off = ["--no-enable-log-requests", "--no-fully-sharded-loras", "--no-disable-sliding-window",
           "--no-headless", "--no-enable-sleep-mode"]
    assert notes("m", *off) == [] and settings("m", *off) == settings("m")


# values vLLM gives another meaning (outputs or memory): (argv, flag named, what to use instead)
REFUSED = [
    (["--tokenizer-mode", "mistral"], "--tokenizer-mode mistral", "Hugging Face tokenizer"),
    (["-pp", "2"], "--pipeline-parallel-size 2", "one replica per GPU"),
    (["--data-parallel-size", "4"], "--data-parallel-size 4", "one replica per GPU"),
    (["--lora-dtype", "float16"], "--lora-dtype float16", "--dtype"),
    (["--task", "embed"], "--task embed", "text generation only"),
    (["--runner", "pooling"], "--runner pooling", "text generation only"),
    (["--load-format", "dummy"], "--load-format dummy", "safetensors"),
    (["--limit-mm-per-prompt", '{"image": 2}'], '--limit-mm-per-prompt {"image": 2}', "text only"),
    (["--otlp-traces-endpoint", "http://otel:4317"], "--otlp-traces-endpoint http://otel:4317", "x-request-id"),
    (["--api-server-count", "4"], "--api-server-count 4", "more replicas"),
    (["--headless"], "--headless", "one replica per GPU"),
    (["--enable-sleep-mode"], "--enable-sleep-mode", "/wake_up"),
    (["--cpu-offload-gb", "8"], "--cpu-offload-gb 8.0", "on the device"),
    (["--hf-overrides", '{"rope_theta": 1}'], '--hf-overrides {"rope_theta": 1}', "config.json"),
    (["--guided-decoding-backend", "xgrammar"], "--guided-decoding-backend xgrammar", "llguidance"),
    (["--structured-outputs-config", '{"backend": "outlines"}'], '--structured-outputs-config {"backend": "outlines"}',
     "llguidance"),
    (["--structured-outputs-config", '{"disable_any_whitespace": true}'],
     '--structured-outputs-config {"disable_any_whitespace": true}', "disable_any_whitespace is served"),
    (["--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}'],
     '--kv-transfer-config {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}', "no KV connector"),
]


@pytest.mark.parametrize("argv,named,instead", REFUSED, ids=[" ".join(a) for a, _, _ in REFUSED])
def test_a_value_with_another_meaning_is_refused_naming_loraplexs_way(argv, named, instead):
    with pytest.raises(VllmFlagError) as caught:
        settings("m", *argv)
    message = str(caught.value)
    assert f"\n  {named}: " in message and instead in message


def test_refused_engine_flags_stop_serve_with_status_2_before_anything_is_built(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path / "home"))
    argv = ["serve", "m", "--lora-dtype", "float16", "-dp", "2", "--tensor-parallel-size", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("loraplex serve: error: vLLM flag(s) loraplex does not take:")
    for flag in ("--lora-dtype float16:", "--data-parallel-size 2:", "--tensor-parallel-size:"):
        assert f"\n  {flag}" in err  # every one named at once
    assert not (tmp_path / "home").exists()  # no registry, no model: nothing started


def test_enable_reasoning_needs_a_parser_as_in_older_vllm():
    with pytest.raises(VllmFlagError, match="--enable-reasoning: requires --reasoning-parser"):
        settings("m", "--enable-reasoning")


def test_cudagraph_mode_none_is_eager_as_enforce_eager_is(monkeypatch):
    monkeypatch.setenv("LORAPLEX_CUDA_GRAPHS", "true")
    assert settings("m").cuda_graphs is True
    assert settings("m", "--compilation-config", '{"cudagraph_mode": "NONE"}').cuda_graphs is False
    assert settings("m", "--compilation-config", '{"cudagraph_mode": "FULL"}').cuda_graphs is True  # speed only
    with pytest.raises(VllmFlagError, match="--cuda-graphs on: give one"):
        settings("m", "--compilation-config", '{"cudagraph_mode": "NONE"}', "--cuda-graphs")


def test_malformed_json_and_optimization_levels_are_argparse_errors(capsys):
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["serve", "--compilation-config", "{not json"])
    assert caught.value.code == 2 and "invalid JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "-O7"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("llama"), "llama")


def test_tokenizer_equal_to_the_model_is_taken_another_is_refused(llama_dir, tmp_path):
    assert settings(str(llama_dir), "--tokenizer", str(llama_dir)) == settings(str(llama_dir))
    assert settings(str(llama_dir), "--tokenizer", f"{llama_dir}/../{llama_dir.name}").model == str(llama_dir)
    with pytest.raises(VllmFlagError, match=r"--tokenizer other/tok: loraplex reads the tokenizer from the model"):
        settings(str(llama_dir), "--tokenizer", "other/tok")


def test_revisions_and_download_dir_are_taken_for_a_local_model_only(llama_dir):
    local = ["--revision", "main", "--tokenizer-revision", "v1", "--code-revision", "v1", "--download-dir", "/tmp/x"]
    assert settings(str(llama_dir), *local) == settings(str(llama_dir))
    assert settings("smollm2", "--revision", "main").model == "smollm2"  # the bundled default is local
    with pytest.raises(VllmFlagError) as caught:
        settings("org/not-here", "--revision", "abc123", "--download-dir", "/cache")
    message = str(caught.value)
    assert "--revision abc123: loraplex makes no downloads" in message
    assert "--download-dir /cache: loraplex makes no downloads" in message and "--local-dir DIR" in message


def test_disable_sliding_window_as_vllm_caps_the_context_at_the_window(llama_dir, tmp_path):
    # no window: vLLM changes nothing, and so does loraplex
    assert settings(str(llama_dir), "--disable-sliding-window") == settings(str(llama_dir))
    mistral = make_tiny_model_dir(tmp_path / "mistral", "mistral", sliding_window=16, max_position_embeddings=128)
    with pytest.raises(VllmFlagError, match=r"--disable-sliding-window: .*\(16 tokens\).*--max-model-len 16"):
        settings(str(mistral), "--disable-sliding-window")
    with pytest.raises(VllmFlagError, match="--max-model-len 16"):
        settings(str(mistral), "--disable-sliding-window", "--max-model-len", "64")
    # within the window, windowed and full attention attend to the same keys: taken
    assert settings(str(mistral), "--disable-sliding-window", "--max-model-len", "16").max_model_len == 16
    gemma = make_tiny_model_dir(tmp_path / "gemma2", "gemma2", sliding_window=32, max_position_embeddings=128)
    with pytest.raises(VllmFlagError, match=r"\(32 tokens\).*--max-model-len 32"):
        settings(str(gemma), "--disable-sliding-window")  # every other layer windowed
    assert settings(str(gemma), "--disable-sliding-window", "--max-model-len", "32").max_model_len == 32
    # Qwen2 with use_sliding_window: layers from max_window_layers on are windowed
    qwen = make_tiny_model_dir(tmp_path / "qwen2", "qwen2", num_hidden_layers=3, use_sliding_window=True,
                               sliding_window=24, max_window_layers=1, max_position_embeddings=128)
    with pytest.raises(VllmFlagError, match=r"\(24 tokens\).*--max-model-len 24"):
        settings(str(qwen), "--disable-sliding-window")
    assert settings(str(qwen), "--disable-sliding-window", "--max-model-len", "24").max_model_len == 24


def test_mm_limits_take_vllms_forms():
    assert vllm_engine_flags.mm_limits('{"image": {"count": 0}, "video": 1}') == {"image": 0, "video": 1}
    assert vllm_engine_flags.mm_limits("image=0, audio=2") == {"image": 0, "audio": 2}
    with pytest.raises(Exception, match="expected a count"):
        vllm_engine_flags.mm_limits(json.dumps({"image": -1}))


def test_the_production_stack_charts_command_line_runs(tmp_path, monkeypatch):
    """The flags vllm-project/production-stack's deployment template writes, underscores and all
    (vLLM's parser reads ``--max_loras`` as ``--max-loras``), through the entry point."""
    seen = {}
    parser = build_parser()
    parser._subparsers._group_actions[0].choices["serve"].set_defaults(func=lambda a: seen.__setitem__("args", a))
    monkeypatch.setattr("loraplex.cli.build_parser", lambda: parser)
    assert main(["serve", "/data/model", "--host", "0.0.0.0", "--port", "8000", "--enable-lora",
                 "--no-enable-chunked-prefill", "--no-enable-prefix-caching", "--max-model-len", "4096",
                 "--dtype", "bfloat16", "--tensor-parallel-size", "1", "--max-num-seqs", "32",
                 "--max_loras", "4", "--max_lora_rank=32", "--kv_cache_dtype", "auto",
                 "--lora-modules", "my_adapter=/data/lora_a"]) == 0
    s = settings_from_args(seen["args"])
    assert (s.model, s.host, s.max_loras, s.max_lora_rank, s.max_num_seqs) == ("/data/model", "0.0.0.0", 4, 32, 32)
    assert (s.enable_chunked_prefill, s.enable_prefix_caching, s.max_model_len) == (False, False, 4096)
    # values are never rewritten: an adapter name with "_" stays as given
    assert [m.name for m in seen["args"].vllm_lora_modules] == ["my_adapter"]


def test_calculate_kv_scales_is_refused_with_an_fp8_kv_cache():
    # vLLM's CacheConfig.calculate_kv_scales: with an fp8 cache, k/v scales computed from the
    # first forward pass instead of the checkpoint's or 1.0; loraplex writes fp8 with the checkpoint's or 1.0
    assert settings("m", "--calculate-kv-scales").kv_cache_dtype == "auto"  # no scales to compute
    assert any(n.startswith("--calculate-kv-scales") for n in notes("m", "--calculate-kv-scales"))
    assert settings("m", "--no-calculate-kv-scales", "--kv-cache-dtype", "fp8").kv_cache_dtype == "fp8"
    for dtype in ("fp8", "fp8_e5m2"):
        with pytest.raises(VllmFlagError, match=f"--calculate-kv-scales: .*--kv-cache-dtype {dtype} cache"):
            settings("m", "--calculate-kv-scales", "--kv-cache-dtype", dtype)
    # a 16-bit cache (the model's dtype) has no scales in vLLM either: the flag changes nothing
    for dtype in ("bfloat16", "float16"):
        args = ("m", "--calculate-kv-scales", "--kv-cache-dtype", dtype, "--dtype", dtype)
        assert settings(*args).kv_cache_dtype == dtype
        assert any(n.startswith("--calculate-kv-scales") for n in notes(*args))


def test_overlap_lora_shrink_is_a_switch_that_reaches_the_engine():
    """loraplex's own option (no vLLM flag means it): off unless asked for."""
    assert settings("m").engine_config().overlap_lora_shrink is False
    assert settings("m", "--overlap-lora-shrink").engine_config().overlap_lora_shrink is True
    assert settings("m", "--overlap-lora-shrink", "--no-overlap-lora-shrink").overlap_lora_shrink is False
