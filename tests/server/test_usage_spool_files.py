"""UsageSpool's files: a batch read back is the batch written, a write is whole or absent, names
stay inside the directory, and a file gone (another process replayed it) is not an error."""

from __future__ import annotations

import json
import os
from datetime import datetime, timedelta, timezone

import pytest

from loraplex.server.usage_outbox import Batch
from loraplex.server.usage_spool import FORMAT, FORMAT_VERSION, SpoolFileError, UsageSpool

H0 = datetime(2026, 12, 3, 14, tzinfo=timezone.utc)
ROWS = {("acme", "sql", H0): (3, 30, 7, 0, 0, 0),
        ("acme", None, H0 + timedelta(hours=1)): (0, 0, 0, 1, 4, 2),
        ("ünï", "a-b", H0): (1, 2**40, 0, 0, 0, 0)}


def test_a_batch_reads_back_as_written(tmp_path):
    spool = UsageSpool(tmp_path / "spool")  # created by the first save
    assert spool.files() == [] and spool.count() == 0
    path = spool.save(Batch("0123abcd", ROWS))
    assert path == tmp_path / "spool" / "0123abcd.json" and spool.files() == [path]
    doc = json.loads(path.read_text())
    assert (doc["format"], doc["version"], doc["batch_id"]) == (FORMAT, FORMAT_VERSION, "0123abcd")
    assert spool.load(path) == ("0123abcd", ROWS)


@pytest.mark.parametrize("batch_id", ["../../escape", "/abs", ".hidden", "a b", "x" * 64])
def test_any_id_gets_a_file_inside_the_directory(tmp_path, batch_id):
    spool = UsageSpool(tmp_path / "spool")
    path = spool.save(Batch(batch_id, ROWS))
    assert path.parent == spool.directory and spool.files() == [path]
    assert spool.load(path) == (batch_id, ROWS)


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    spool = UsageSpool(tmp_path / "spool")

    def no_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_disk)
    with pytest.raises(OSError):
        spool.save(Batch("abc", ROWS))
    assert list(spool.directory.iterdir()) == []


def test_only_whole_batch_files_are_listed(tmp_path):
    spool = UsageSpool(tmp_path / "spool")
    path = spool.save(Batch("abc", ROWS))
    for name in (".abc.json.123.tmp", "old.json.bad", "notes.txt"):
        (spool.directory / name).write_text("x")
    assert spool.files() == [path]


def test_a_file_another_process_took_first(tmp_path):
    spool = UsageSpool(tmp_path / "spool")
    path = spool.save(Batch("abc", ROWS))
    spool.remove(path)
    spool.remove(path)  # the other process deleted it too
    with pytest.raises(FileNotFoundError):
        spool.load(path)
    assert spool.set_aside(path) is None


@pytest.mark.parametrize("text", [
    b"\xff\xfe", "[]", "{}", '{"format": "loraplex.usage-batch", "version": 1}',
    '{"format": "loraplex.usage-batch", "version": 1, "batch_id": "", "rows": []}',
    '{"format": "loraplex.usage-batch", "version": 1, "batch_id": "a", "rows": [{"tenant": "t"}]}',
    '{"format": "loraplex.usage-batch", "version": 1, "batch_id": "a", "rows": [{"tenant": "t", "adapter": null,'
    ' "hour": "2026-12-03T14:00:00", "counts": {}}]}',  # an hour without its zone
])
def test_what_is_not_a_batch_is_a_spool_file_error(tmp_path, text):
    path = tmp_path / "x.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(SpoolFileError):
        UsageSpool(tmp_path).load(path)
