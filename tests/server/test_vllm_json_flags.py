"""vLLM's dotted and JSON forms of its config-group flags on ``loraplex serve`` and ``run-batch``
(loraplex/server/vllm_argv.py), in the command line and in ``--config FILE.yaml``. The reference
is vLLM's documentation of its parser ("vllm serve" CLI reference, "JSON CLI arguments"):

    --json-arg '{"key1": "value1", "key2": {"key3": "value2"}}'
    --json-arg.key1 value1 --json-arg.key2.key3 value2
    --json-arg '{"key4": ["value3", "value4", "value5"]}'
    --json-arg.key4+ value3 --json-arg.key4+='value4,value5'

are the same, and ``-O3`` / ``-O 3`` / ``-O=3`` is ``--optimization-level 3`` (docs.vllm.ai
"Optimization Levels": ``-O0`` runs without compilation and without CUDA graphs)."""

from __future__ import annotations

import json

import pytest

from loraplex.server import vllm_engine_flags
from loraplex.server.cli import settings_from_args
from loraplex.server.vllm_argv import dashed_flag_names
from loraplex.server.vllm_flags import VllmFlagError
from tests.server.cli_parsing import no_cli_env, parsed  # noqa: F401 (fixtures)


pytestmark = pytest.mark.usefixtures("no_cli_env")


def test_dotted_keys_are_the_json_object_vllm_documents(parsed):
    whole = parsed(["serve", "m", "--hf-overrides", '{"key1": "value1", "key2": {"key3": "value2"}}'])
    dotted = parsed(["serve", "m", "--hf-overrides.key1", "value1", "--hf-overrides.key2.key3", "value2"])
    assert dotted.vllm_hf_overrides == whole.vllm_hf_overrides == {"key1": "value1", "key2": {"key3": "value2"}}
    listed = parsed(["serve", "m", "--hf-overrides.key4+", "value3", "--hf-overrides.key4+=value4,value5"])
    assert listed.vllm_hf_overrides == {"key4": ["value3", "value4", "value5"]}


def test_dotted_speculative_config_runs_loraplexs_ngram(parsed):
    dotted = parsed(["serve", "m", "--speculative-config.method", "ngram",
                     "--speculative_config.num_speculative_tokens=3", "--speculative-config.prompt_lookup_max", "4"])
    spec = settings_from_args(dotted).engine_config().speculative_config
    whole = parsed(["serve", "m", "--speculative-config",
                    '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'])
    assert spec == settings_from_args(whole).engine_config().speculative_config
    assert json.loads(settings_from_args(dotted).speculative_config)["num_speculative_tokens"] == 3  # a number


def test_override_generation_config_dotted_and_whole_agree(parsed):
    whole = settings_from_args(parsed(["serve", "m", "--override-generation-config", '{"temperature": 0.5}']))
    dotted = settings_from_args(parsed(["serve", "m", "--override-generation-config.temperature", "0.5"]))
    assert json.loads(dotted.override_generation_config) == json.loads(whole.override_generation_config)


def test_refused_json_flags_are_refused_in_the_dotted_form_too(parsed):
    args = parsed(["serve", "m", "--kv-transfer-config.kv_connector", "LMCacheConnectorV1",
                   "--kv-transfer-config.kv_role", "kv_both"])
    with pytest.raises(VllmFlagError, match=r'--kv-transfer-config \{"kv_connector": "LMCacheConnectorV1", '
                                            r'"kv_role": "kv_both"\}: loraplex keeps the KV cache'):
        settings_from_args(args)


@pytest.mark.parametrize("argv", [["-O3"], ["-O", "3"], ["-O=3"], ["--optimization-level", "3"]])
def test_optimization_level_forms(argv, parsed):
    assert parsed(["serve", "m", *argv]).vllm_optimization_level == "3"


def test_O0_and_cudagraph_mode_none_turn_cuda_graphs_off(parsed, monkeypatch):
    monkeypatch.setenv("LORAPLEX_CUDA_GRAPHS", "true")
    assert settings_from_args(parsed(["serve", "m", "-O3"])).cuda_graphs is True  # speed only: left as set
    assert settings_from_args(parsed(["serve", "m", "-O0"])).cuda_graphs is False
    assert settings_from_args(parsed(["serve", "m", "-O.cudagraph_mode", "NONE"])).cuda_graphs is False
    assert settings_from_args(parsed(["serve", "m", "--compilation-config.cudagraph_mode=NONE"])).cuda_graphs is False
    with pytest.raises(VllmFlagError, match="-O 0 turns CUDA graphs off and --cuda-graphs on: give one"):
        settings_from_args(parsed(["serve", "m", "-O0", "--cuda-graphs"]))


@pytest.mark.parametrize("argv, graphs", [
    # vLLM (vllm/config/vllm.py): a mode other than its compiler (3) defaults cudagraph_mode to
    # NONE and overrides a piecewise one to NONE; FULL graphs need no compiler and are kept
    (["--compilation-config", '{"level": 0}'], False),
    (["--compilation-config", "0"], False),  # the bare level, older -O0
    (["--compilation-config.mode", "0"], False),
    (["-O.level", "0"], False),
    (["-cc.mode=0"], False),  # vLLM's short name, as its VllmConfig doc writes it (-cc.mode=3)
    (["-cc", '{"level": 0}'], False),
    (["--compilation-config", '{"mode": "NONE"}'], False),
    (["--compilation-config", '{"level": 2}'], False),
    (["--compilation-config", '{"mode": 0, "cudagraph_mode": "PIECEWISE"}'], False),
    (["--compilation-config", '{"use_cudagraph": false}'], False),
    (["--compilation-config", '{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}'], True),
    (["--compilation-config", '{"level": 3}'], True),
    (["--compilation-config", '{"cudagraph_capture_sizes": [1, 2]}'], True),
])
def test_compilation_config_without_graphs_turns_cuda_graphs_off(argv, graphs, parsed, monkeypatch):
    monkeypatch.setenv("LORAPLEX_CUDA_GRAPHS", "true")
    assert settings_from_args(parsed(["serve", "m", *argv])).cuda_graphs is graphs


def test_compilation_level_0_and_cuda_graphs_conflict(parsed):
    with pytest.raises(VllmFlagError, match="turns CUDA graphs off and --cuda-graphs on: give one"):
        settings_from_args(parsed(["serve", "m", "--compilation-config", '{"level": 0}', "--cuda-graphs"]))


def test_compilation_config_takes_vllms_bare_level_and_dotted_keys(parsed):
    assert parsed(["serve", "m", "--compilation-config", "3"]).vllm_compilation_config == {"level": 3}
    assert parsed(["serve", "m", "-O", '{"cudagraph_mode": "NONE"}']).vllm_compilation_config == {
        "cudagraph_mode": "NONE"}  # vLLM's -O with a JSON object is --compilation-config
    args = parsed(["serve", "m", "--compilation-config.level", "3", "--compilation-config.cudagraph_capture_sizes+",
                   "1,2"])
    assert args.vllm_compilation_config == {"level": 3, "cudagraph_capture_sizes": ["1", "2"]}
    assert any(n.startswith("--compilation-config") for n in vllm_engine_flags.notes(args))


@pytest.mark.parametrize("argv", [
    ["--attention-config", '{"backend": "FLASH_ATTN", "flash_attn_version": 3}'],
    ["-ac", '{"backend": "FLASH_ATTN", "flash_attn_version": 3}'],
    ["-ac.backend", "FLASH_ATTN", "-ac.flash_attn_version=3"],
    ["--attention-config.backend", "FLASH_ATTN", "--attention_config.flash_attn_version", "3"],
])
def test_attention_config_forms_are_one_object_taken_with_a_note(argv, parsed):
    """vLLM's AttentionConfig flag in the forms its docs give ("Attention Backend Feature Support"):
    a kernel choice, taken as --attention-backend is, with a note, and no setting changed."""
    args = parsed(["serve", "m", *argv])
    assert args.vllm_attention_config == {"backend": "FLASH_ATTN", "flash_attn_version": 3}
    assert settings_from_args(args) == settings_from_args(parsed(["serve", "m"]))
    assert [n.split(":")[0] for n in vllm_engine_flags.notes(args)] == ["--attention-config"]


def test_flag_names_lose_underscores_before_the_first_dot_only():
    assert dashed_flag_names(["--speculative_config.num_speculative_tokens=3", "--max_loras", "a_b"]) == [
        "--speculative-config.num_speculative_tokens=3", "--max-loras", "a_b"]


def test_a_dotted_flag_without_a_value_or_of_no_flag_is_an_error(parsed, capsys):
    with pytest.raises(SystemExit):
        parsed(["serve", "m", "--compilation-config.level"])
    assert "--compilation-config.level: expected a value" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parsed(["serve", "m", "--compilaton-config.level", "3"])
    assert "did you mean --compilation-config?" in capsys.readouterr().err


def test_config_file_nested_mappings_and_dotted_keys(parsed, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("speculative-config:\n  method: ngram\n  num_speculative_tokens: 3\n"
                      "speculative-config.prompt_lookup_max: 4\n"
                      "compilation_config.cudagraph_mode: NONE\n"
                      "override-generation-config: {temperature: 0.5}\n")
    s = settings_from_args(parsed(["serve", "m", "--config", str(config)]))
    assert json.loads(s.speculative_config) == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    assert (s.cuda_graphs, json.loads(s.override_generation_config)) == (False, {"temperature": 0.5})
    # the command line wins over the file, as vLLM documents
    s = settings_from_args(parsed(["serve", "m", "--config", str(config), "--override-generation-config.temperature",
                                   "0.2"]))
    assert json.loads(s.override_generation_config) == {"temperature": 0.2}


def test_config_file_refuses_what_the_command_line_refuses(parsed, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("kv-transfer-config.kv_connector: LMCacheConnectorV1\nrope-theta: 500000\n")
    with pytest.raises(VllmFlagError) as caught:
        settings_from_args(parsed(["serve", "m", "--config", str(config)]))
    assert "--kv-transfer-config" in str(caught.value) and "--rope-theta" in str(caught.value)


def test_run_batch_reads_the_same_forms(parsed, tmp_path):
    base = ["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "--model", "m"]
    s = settings_from_args(parsed([*base, "--speculative-config.method", "ngram",
                                   "--speculative-config.num_speculative_tokens", "2", "-O0"]))
    assert json.loads(s.speculative_config) == {"method": "ngram", "num_speculative_tokens": 2}
    config = tmp_path / "batch.yaml"
    config.write_text("override-generation-config.top_p: 0.9\n")
    s = settings_from_args(parsed([*base, "--config", str(config)]))
    assert json.loads(s.override_generation_config) == {"top_p": 0.9}
    with pytest.raises(VllmFlagError, match="--rope-theta"):
        settings_from_args(parsed([*base, "--rope-theta", "500000"]))
