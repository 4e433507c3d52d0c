"""``loraplex run-batch`` when the run itself cannot happen: a non-zero exit status, the reason on
stderr, and no output file (nor a partial one) left behind."""

from __future__ import annotations

import json

import pytest

from loraplex.cli import main

LINE = json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {"model": "m", "prompt": "x"}})


@pytest.fixture
def batch(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(LINE + "\n")
    return source, tmp_path / "out" / "results.jsonl"


def _run(argv: list[str], home) -> int:
    return main(["run-batch", "--home", str(home), "--device", "cpu", *argv])


def _left_behind(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_unreadable_input_or_unwritable_output_is_status_2(batch, tmp_path, capsys):
    source, out = batch
    assert _run(["-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "r.jsonl")], tmp_path / "h") == 2
    assert "cannot read the input file" in capsys.readouterr().err
    assert _run(["-i", str(source), "-o", str(out)], tmp_path / "h") == 2  # its folder does not exist
    assert "cannot write the output file" in capsys.readouterr().err
    assert not (tmp_path / "r.jsonl").exists() and not out.parent.exists()
    assert _run(["-i", str(source), "-o", str(tmp_path / "r.jsonl"), "--max-concurrency", "0"], tmp_path / "h") == 2


def test_missing_model_is_status_1_and_leaves_no_output(batch, tmp_path, capsys):
    source, out = batch
    out.parent.mkdir()
    assert _run(["-i", str(source), "-o", str(out), "--model", str(tmp_path / "no-such-model")], tmp_path / "h") == 1
    assert "cannot load the model" in capsys.readouterr().err
    assert _left_behind(out.parent) == []


def test_bad_lora_modules_and_unknown_tenant_are_status_2(batch, tiny_llama_dir, tmp_path, capsys):
    source, out = batch
    out.parent.mkdir()
    common = ["-i", str(source), "-o", str(out), "--model", str(tiny_llama_dir), "--dtype", "float32",
              "--kv-cache-bytes", str(1 << 20)]
    assert _run([*common, "--lora-modules", "sql"], tmp_path / "h") == 2
    assert "expected name=path" in capsys.readouterr().err
    assert _run([*common, "--tenant", "nobody"], tmp_path / "h") == 2
    assert "no tenant 'nobody'" in capsys.readouterr().err
    assert _run([*common, "--lora-modules", f"sql={tmp_path / 'no-adapter'}"], tmp_path / "h") == 2
    assert "--lora-modules" in capsys.readouterr().err
    assert _left_behind(out.parent) == []


def test_an_output_path_that_is_a_directory_is_status_2_before_the_model_loads(batch, tmp_path, capsys):
    """Renaming the results over a directory fails; found only after every line ran, the whole
    run was lost and its hidden .partial file left behind."""
    source, out = batch
    folder = out.parent
    (folder / "results").mkdir(parents=True)
    assert _run(["-i", str(source), "-o", str(folder / "results"), "--model", str(tmp_path / "no-such-model")],
                tmp_path / "h") == 2
    assert "cannot write the output file" in capsys.readouterr().err
    assert _left_behind(folder) == ["results"] and _left_behind(folder / "results") == []


def test_a_reasoning_parser_the_tokenizer_cannot_serve_is_status_2(batch, tiny_llama_dir, tmp_path, capsys):
    """The tiny model's byte-level tokenizer spells <think> in 7 tokens: refused as `serve` does."""
    source, out = batch
    out.parent.mkdir()
    argv = ["-i", str(source), "-o", str(out), "--model", str(tiny_llama_dir), "--dtype", "float32",
            "--kv-cache-bytes", str(1 << 20), "--reasoning-parser", "deepseek_r1"]
    assert _run(argv, tmp_path / "h") == 2
    assert "--reasoning-parser deepseek_r1: <think> is not one token" in capsys.readouterr().err
    assert _left_behind(out.parent) == []
