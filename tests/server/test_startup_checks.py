"""A wrong start-up value of ``loraplex serve`` / ``sglang-serve`` stops the command at once:
exit status 2 (argparse's), one line on stderr naming the flag as it was typed, and nothing
started (no registry opened: ``prepare_registry`` is replaced by a trap, and ``LORAPLEX_HOME`` is
never created). Before, each of these passed ``Settings`` and failed later: after the model load
(``--device foo``, ``--dtype foo``, ``--blob-url ftp://x``, a ``--max-model-len`` past the
model's context), at the socket's bind (``--port 99999``), as a traceback (``--database-url foo``,
``--chat-template`` naming no file), or after the registry had been created and its one-time
keys printed (``--api-key ''``, ``--vllm-tenant 'Bad Name'``, a ``--lora-modules`` path that is
no directory)."""

from __future__ import annotations

import json
import os

import pytest

from loraplex.cli import main
from loraplex.server.vllm_flag_kinds import human_readable_int

CONTEXT = 16384  # the tiny model's max_position_embeddings: 16k (16000) fits, 16K (16384) too, 17k not


class Started(Exception):
    """Raised where the server would open its registry: every check has passed."""


@pytest.fixture
def model_dir(tmp_path):
    """A Hugging Face directory's config.json (nothing here reads weights)."""
    directory = tmp_path / "tiny"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 300,
        "max_position_embeddings": CONTEXT, "rms_norm_eps": 1e-5}))
    return directory


@pytest.fixture
def home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("LORAPLEX_HOME", str(home))
    for name in [n for n in os.environ if n.startswith(("LORAPLEX_", "VLLM_"))]:
        if name != "LORAPLEX_HOME":
            monkeypatch.delenv(name)

    def trap(*args, **kwargs):
        raise Started

    monkeypatch.setattr("loraplex.server.components.prepare_registry", trap)
    return home


def refused(capsys, home, argv: list[str]) -> str:
    """The one line a refused command printed; fails if it started or exited otherwise."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not home.exists()  # no registry, no converted model: nothing started
    return err.strip()


BAD_SERVE_VALUES = [
    (["--port", "99999"], "--port: "),
    (["--port", "-1"], "--port: "),
    (["--dtype", "foo"], "--dtype: dtype 'foo' is not served"),
    (["--device", "foo"], "--device: device 'foo' is not served"),
    (["--device", "cuda:99"], "--device cuda:99: "),  # no CUDA here, or no 100th device
    (["--max-model-len", "17k"], "--max-model-len 17000: max_model_len=17000 must be in [1, 16384]"),
    (["--api-key", ""], "--api-key #1: a key has 1 to 256 characters"),
    (["--api-key", "k" * 8, "--vllm-tenant", "Bad Name"], "--vllm-tenant 'Bad Name': "),
    (["--lora-modules", "a=/no/such/dir"], "--lora-modules a=/no/such/dir: adapter path '/no/such/dir' is not a directory"),
    (["--database-url", "foo"], "--database-url: not a database URL"),
    (["--database-url", "nosuchdialect://u:secret@h/db"], "--database-url: Can't load plugin"),
    (["--blob-url", "ftp://x"], "--blob-url: unsupported blob url 'ftp://x'"),
    (["--chat-template", "/no/such/template.jinja"], "--chat-template '/no/such/template.jinja': no such file"),
    (["--chat-template", "{% if %}"], "--chat-template: the template does not compile"),
    (["--kv-cache-bytes", "0"], "--kv-cache-bytes: "),
    (["--kv-cache-memory-fraction", "1.5"], "--kv-cache-memory-fraction: "),
    (["--max-n", "0"], "--max-n: "),
    (["--max-prompt-tokens", "0"], "--max-prompt-tokens: "),
    (["--max-body-bytes", "0"], "--max-body-bytes: "),
    (["--max-concurrent-requests-per-tenant", "0"], "--max-concurrent-requests-per-tenant: "),
    (["--shutdown-grace-seconds", "-1"], "--shutdown-grace-seconds: "),
    (["--registry-poll-seconds", "-1"], "--registry-poll-seconds: "),
    (["--max-num-seqs", "0"], "--max-num-seqs=0: must be at least 1"),  # a model validator's, in flag words
    (["--max-loras", "9", "--max-cpu-loras", "2"], "--max-cpu-loras (2) must be >= --max-loras (9)"),
    (["--ssl-certfile", "/no/such/cert.pem"], "TLS: cannot load --ssl-certfile /no/such/cert.pem"),
]


@pytest.mark.parametrize("argv, words", BAD_SERVE_VALUES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_bad_value_stops_serve_at_once_naming_its_flag(capsys, home, model_dir, argv, words):
    line = refused(capsys, home, ["serve", str(model_dir), *argv])
    assert line.startswith(f"loraplex serve: error: {words}"), line
    assert "secret" not in line  # a database URL's password is never repeated


def test_a_model_that_is_not_there_is_said_before_anything_starts(capsys, home, tmp_path):
    line = refused(capsys, home, ["serve", str(tmp_path / "nothing")])
    assert line.startswith("loraplex serve: error: --model: model ") and "not found" in line


def test_a_value_from_the_environment_is_named_by_its_variable(capsys, home, model_dir, monkeypatch):
    monkeypatch.setenv("LORAPLEX_PORT", "70000")
    line = refused(capsys, home, ["serve", str(model_dir)])
    assert line.startswith("loraplex serve: error: LORAPLEX_PORT: "), line


@pytest.mark.parametrize("variable, value, words", [
    ("LORAPLEX_DEVICE", "cuda:99", "LORAPLEX_DEVICE cuda:99: "),
    ("LORAPLEX_MAX_MODEL_LEN", "17000", "LORAPLEX_MAX_MODEL_LEN 17000: max_model_len=17000 must be in [1, 16384]"),
    ("LORAPLEX_DATABASE_URL", "foo", "LORAPLEX_DATABASE_URL: not a database URL"),
    ("LORAPLEX_BLOB_URL", "ftp://x", "LORAPLEX_BLOB_URL: unsupported blob url 'ftp://x'"),
    ("LORAPLEX_CHAT_TEMPLATE", "/no/such/template.jinja", "LORAPLEX_CHAT_TEMPLATE '/no/such/template.jinja': no such file"),
])
def test_a_value_from_the_environment_the_checks_refuse_is_named_by_its_variable(
        capsys, home, model_dir, monkeypatch, variable, value, words):
    # a Deployment's env (deploy/k8s/loraplex.yaml) sets these: the pod's command line has no such flag
    monkeypatch.setenv(variable, value)
    line = refused(capsys, home, ["serve", str(model_dir)])
    assert line.startswith(f"loraplex serve: error: {words}"), line


def test_a_model_from_the_environment_that_is_not_there_is_named_by_its_variable(capsys, home, tmp_path, monkeypatch):
    monkeypatch.setenv("LORAPLEX_MODEL", str(tmp_path / "nothing"))
    line = refused(capsys, home, ["serve"])
    assert line.startswith("loraplex serve: error: LORAPLEX_MODEL: model "), line


def test_the_dtype_from_the_environment_is_named_as_set(capsys, home, model_dir, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("float16 runs on the GPU this machine has")
    monkeypatch.setenv("LORAPLEX_DTYPE", "half")
    line = refused(capsys, home, ["serve", str(model_dir)])
    assert line.startswith("loraplex serve: error: LORAPLEX_DTYPE half: float16 is not supported on CPU"), line


def test_the_dtype_is_named_as_typed(capsys, home, model_dir):
    # vLLM's half is float16, which the CPU does not run; on a GPU machine it does: no refusal
    import torch

    if torch.cuda.is_available():
        pytest.skip("float16 runs on the GPU this machine has")
    line = refused(capsys, home, ["serve", str(model_dir), "--dtype", "half"])
    assert line.startswith("loraplex serve: error: --dtype half: float16 is not supported on CPU"), line


@pytest.mark.parametrize("argv", [
    ["--max-model-len", "16k"], ["--max-model-len", "16K"], ["--max-model-len", "auto"], ["--port", "0"],
    ["--port", "65535"], ["--dtype", "float"], ["--device", "cpu"], ["--kv-cache-memory-fraction", "1"],
    ["--database-url", "sqlite:////tmp/x.db"], ["--blob-url", "s3://bucket/prefix"], ["--chat-template", "{{ x }}"],
    ["--api-key", "k" * 8, "--vllm-tenant", "team-a"],
])
def test_good_values_pass_every_check(home, model_dir, argv):
    """The same path, with values vLLM takes: the command gets as far as opening its registry."""
    with pytest.raises(Started):
        main(["serve", str(model_dir), *argv])


def test_human_readable_ints_as_vllm_reads_them():
    """vLLM's ``human_readable_int`` (vllm/engine/arg_utils.py): k/m/g/t decimal with decimals
    allowed, K/M/G/T binary in whole numbers."""
    assert [human_readable_int(v) for v in ("8k", "25.6k", "1m", "2g", "1t", "8K", "1M", "1G", "1T", "4096")] == [
        8000, 25600, 10**6, 2 * 10**9, 10**12, 8192, 2**20, 2**30, 2**40, 4096]
    for bad in ("1.5K", "8ki", "k", "8x"):
        with pytest.raises(Exception):
            human_readable_int(bad)


SGLANG_BAD_VALUES = [
    (["--context-length", "17k"], "--context-length 17000: "),  # SGLang's name of --max-model-len
    (["--port", "99999"], "--port: "),
    (["--device", "foo"], "--device: "),
    (["--ssl-certfile", "/no/such/cert.pem"], "TLS: cannot load --ssl-certfile"),
    (["--lora-paths", "a=/no/such/dir"], "--lora-paths a=/no/such/dir: adapter path"),
    (["--max-running-requests", "0"], "--max-running-requests=0: must be at least 1"),
]


@pytest.mark.parametrize("argv, words", SGLANG_BAD_VALUES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_sglang_serve_says_its_own_name_and_flags(capsys, home, model_dir, argv, words):
    line = refused(capsys, home, ["sglang-serve", "--model-path", str(model_dir), *argv])
    assert line.startswith(f"loraplex sglang-serve: error: {words}"), line


def test_sglang_serve_names_itself_for_errors_serve_finds_after_the_checks(capsys, home, model_dir, monkeypatch):
    """An error run_serve raises once the registry is open (here: storing the --lora-paths
    adapter) names sglang-serve and the SGLang flag, not serve's."""
    from loraplex.server import vllm_startup

    class Setup:
        registry, admin_secret, demo_key, notes = object(), None, None, []

    def refuse(flags, settings, registry):
        raise vllm_startup.StartupError("--lora-modules a=/x: refused for the test")

    monkeypatch.setattr("loraplex.server.components.prepare_registry", lambda *a, **k: Setup)
    monkeypatch.setattr(vllm_startup, "apply_startup_flags", refuse)
    adapter = model_dir.parent / "adapter"
    adapter.mkdir()
    assert main(["sglang-serve", "--model-path", str(model_dir), "--lora-paths", f"a={adapter}"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "loraplex sglang-serve: error: --lora-paths a=/x: refused for the test"


@pytest.mark.parametrize("flag", [False, True])
def test_a_home_nothing_can_be_written_in_is_said_before_anything_starts(capsys, tmp_path, model_dir, monkeypatch,
                                                                        home, flag):
    (tmp_path / "a-file").write_text("")
    unusable = tmp_path / "a-file" / "home"  # a path under a file: it was a traceback and exit 1
    argv = ["serve", str(model_dir)]
    if flag:
        argv += ["--home", str(unusable)]
    else:
        monkeypatch.setenv("LORAPLEX_HOME", str(unusable))
    line = refused(capsys, unusable, argv)
    name = "--home" if flag else "LORAPLEX_HOME"
    assert line.startswith(f"loraplex serve: error: {name} {unusable}: not a folder loraplex can write in"), line


def test_a_setting_a_rule_over_several_refuses_is_named_by_its_variable(capsys, home, model_dir, monkeypatch):
    monkeypatch.setenv("LORAPLEX_MAX_LORAS", "0")  # it said --max-loras, which the command line never had
    line = refused(capsys, home, ["serve", str(model_dir)])
    assert line.startswith("loraplex serve: error: LORAPLEX_MAX_LORAS=0: must be at least 1"), line
    monkeypatch.delenv("LORAPLEX_MAX_LORAS")
    line = refused(capsys, home, ["serve", str(model_dir), "--max-loras", "0"])
    assert line.startswith("loraplex serve: error: --max-loras=0: must be at least 1"), line
