"""run-batch's output file is written beside its target and renamed over it; it must still end
with the permissions vLLM's ``open(path, "w")`` gives it, so a results file is as readable as any
file its user writes."""

from __future__ import annotations

import os
import stat

import pytest

from loraplex.server.batch_cli import BatchOutput


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_output_file_gets_the_mode_a_plain_write_gives(tmp_path, umask_022):
    reference = tmp_path / "reference.jsonl"
    with open(reference, "w", encoding="utf-8") as handle:  # what vLLM's run_batch does
        handle.write("{}\n")
    output = BatchOutput(str(tmp_path / "results.jsonl"))
    output.write("{}\n")
    output.commit()
    assert _mode(tmp_path / "results.jsonl") == _mode(reference) == 0o644


def test_an_existing_output_file_keeps_its_mode(tmp_path, umask_022):
    target = tmp_path / "results.jsonl"
    target.write_text("old\n")
    target.chmod(0o640)
    output = BatchOutput(str(target))
    output.write("{}\n")
    output.commit()
    assert target.read_text() == "{}\n" and _mode(target) == 0o640
