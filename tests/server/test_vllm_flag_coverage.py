"""Every flag ``vllm serve`` documents (tests/fixtures/vllm_serve_flags.py, written from vLLM's
parser and docs) on ``loraplex serve``, and its engine flags on ``loraplex run-batch``: each
parses, through the entry point, to loraplex settings (a flag of loraplex's vLLM table then logs
why it changes nothing) or to loraplex's refusal naming the flag; never argparse's generic
"unrecognized arguments". A flag that is no one's gets the closest known one suggested."""

from __future__ import annotations


import pytest
from pydantic import ValidationError

from loraplex import cli as loraplex_cli
from loraplex.generation_defaults import GenerationConfigError
from loraplex.server import vllm_engine_flags, vllm_flags
from loraplex.server.cli import settings_from_args
from loraplex.server.vllm_flags import VllmFlagError
from tests.server.cli_parsing import no_cli_env, parsed  # noqa: F401 (fixtures)
from tests.fixtures import vllm_serve_flags as reference

BATCH_PREFIX = ["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "--model", "m"]


pytestmark = pytest.mark.usefixtures("no_cli_env")


def _action(command: str, flag: str):
    """The argparse action ``flag`` is an option string of in ``loraplex command``."""
    return loraplex_cli.build_parser()._subparsers._group_actions[0].choices[command]._option_string_actions[flag]


def _check_flag(parsed, capsys, prefix: list[str], flag: str, values: list[str]) -> None:
    try:
        args = parsed([*prefix, flag, *values])
    except SystemExit:
        pytest.fail(f"{flag} {' '.join(values)}: argparse refused it: {capsys.readouterr().err[-400:]}")
    action = _action(prefix[0], flag)
    names = [*action.option_strings, action.dest.removeprefix("vllm_")]  # -tp: --tensor-parallel-size
    try:
        settings_from_args(args)
    except (VllmFlagError, GenerationConfigError, ValidationError) as exc:
        assert any(name in str(exc) for name in names), f"{flag}: the refusal does not name it: {exc}"
        return
    dest = action.dest.removeprefix("vllm_")
    in_table = dest in vllm_engine_flags.ENGINE_FLAGS or dest in vllm_engine_flags.MODEL_FLAGS
    if action.dest.startswith("vllm_") and in_table:
        notes = vllm_engine_flags.notes(args)
        assert any(note.startswith(tuple(names)) for note in notes), f"{flag}: taken without a note: {notes}"


@pytest.mark.parametrize("flag", list(reference.SERVE_FLAGS))
def test_every_vllm_serve_flag_is_taken_or_refused_by_name(flag, parsed, capsys):
    prefix = ["serve"] if flag == "--model" else ["serve", "m"]
    _check_flag(parsed, capsys, prefix, flag, reference.SERVE_FLAGS[flag])


@pytest.mark.parametrize("flag", list(reference.RUN_BATCH_FLAGS))
def test_every_vllm_run_batch_flag_is_taken_or_refused_by_run_batch(flag, parsed, capsys):
    _check_flag(parsed, capsys, BATCH_PREFIX, flag, reference.RUN_BATCH_FLAGS[flag])


def test_loraplexs_table_holds_only_vllms_flags():
    documented = set(reference.SERVE_FLAGS) | set(reference.RUN_BATCH_FLAGS)
    rows = [flag.flags for flag in vllm_engine_flags.ENGINE_FLAGS.values()]
    rows += [flags for flags, _ in vllm_engine_flags.MODEL_FLAGS.values()]
    rows += [flags for flags, _, _ in vllm_flags.REFUSED.values()]
    assert [flags for flags in rows if not set(flags) <= documented] == []


@pytest.mark.parametrize("argv,named", [
    (["--tokenizer-mode", "slow"], "Hugging Face tokenizer"),
    (["--logprobs-mode", "processed_logprobs"], "raw_logprobs"),
    (["--rope-scaling", '{"rope_type": "dynamic", "factor": 2.0}'], "rope scaling"),
    (["--default-chat-template-kwargs", '{"enable_thinking": false}'], "chat_template_kwargs"),
    (["--kv-sharing-fast-prefill"], "changes outputs"),
    (["--data-parallel-address", "10.0.0.1"], "one device"),
])
def test_values_that_change_outputs_are_refused_with_loraplexs_way(argv, named, parsed):
    with pytest.raises(VllmFlagError, match=named):
        settings_from_args(parsed(["serve", "m", *argv]))


def test_taken_flags_with_loraplexs_own_settings(parsed):
    s = settings_from_args(parsed(["serve", "m", "--kv-cache-memory-bytes", "8G"]))
    assert s.kv_cache_bytes == 8 * 1024**3  # vLLM's human-readable G: powers of 1024
    assert settings_from_args(parsed(["serve", "m", "--dtype", "float32", "--seed", "7"])).dtype == "float32"
    with pytest.raises(VllmFlagError, match="size the same KV cache: give one"):
        settings_from_args(parsed(["serve", "m", "--kv-cache-memory-bytes", "8G", "--kv-cache-bytes", "1000"]))


def test_an_unknown_flag_gets_the_closest_known_one(parsed, capsys):
    with pytest.raises(SystemExit) as caught:
        parsed(["serve", "m", "--max-lorass", "4", "--kv-cache-dtpye=auto", "--frobnicate"])
    err = capsys.readouterr().err
    assert caught.value.code == 2
    assert "unrecognized arguments: --max-lorass 4 --kv-cache-dtpye=auto --frobnicate" in err
    assert "--max-lorass: did you mean --max-loras?" in err
    assert "--kv-cache-dtpye: did you mean --kv-cache-dtype?" in err
    assert "--frobnicate: no such flag" in err
    with pytest.raises(SystemExit):
        parsed([*BATCH_PREFIX, "--max-num-seq", "4", "--max-num-seqz", "4"])
    assert "--max-num-seqz: did you mean --max-num-seqs?" in capsys.readouterr().err


def test_run_batchs_metrics_server_is_refused_and_its_address_taken(parsed):
    with pytest.raises(VllmFlagError, match="--enable-metrics: loraplex run-batch serves no Prometheus metrics"):
        settings_from_args(parsed([*BATCH_PREFIX, "--enable-metrics", "--port", "9000"]))
    args = parsed([*BATCH_PREFIX, "--url", "0.0.0.0", "--port", "9000", "--output-tmp-dir", "/tmp"])
    assert settings_from_args(args) == settings_from_args(parsed(BATCH_PREFIX))
    assert [n.split(":")[0] for n in vllm_engine_flags.notes(args)] == ["--output-tmp-dir", "--url", "--port"]


def test_a_refused_flag_given_as_loraplex_runs_is_taken_without_an_empty_note(parsed):
    args = parsed(["serve", "m", "--no-enable-server-load-tracking", "--rope-scaling", "{}", "--hf-overrides", "{}"])
    assert settings_from_args(args) == settings_from_args(parsed(["serve", "m"]))
    assert vllm_engine_flags.notes(args) == []


def test_h11_event_size_reaches_uvicorn_and_front_end_flags_stay_off_run_batch(parsed, capsys):
    import uvicorn

    args = parsed(["serve", "m", "--h11-max-incomplete-event-size", "8388608"])
    config = uvicorn.Config(lambda scope, receive, send: None, **vllm_engine_flags.uvicorn_options(args))
    assert config.h11_max_incomplete_event_size == 8388608
    assert vllm_engine_flags.uvicorn_options(parsed(["serve", "m"])) == {}
    with pytest.raises(SystemExit):  # vLLM's run_batch has no HTTP front end either
        parsed([*BATCH_PREFIX, "--uds", "/tmp/s.sock"])
    assert "unrecognized arguments: --uds" in capsys.readouterr().err
