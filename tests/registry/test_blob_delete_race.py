"""A blob delete racing an upload of the same bytes, forced into the bad interleaving.

The deleter (a version delete, or garbage collection) finds no live version using the blob and
is then held just before the store delete; meanwhile an upload of identical bytes (another
tenant) finds the blob present and adds its version row. Without a lock shared by "count, then
delete" and "add a row", the upload returns and the delete then removes the blob under the new
row. With it, the upload waits for the delete to finish and stores the blob again.

Run on SQLite and PostgreSQL, in one process (threads) and across two processes.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from loraplex.lora.peft_format import compute_content_hash
from loraplex.registry.errors import BlobMissing
from loraplex.storage.base import content_key, open_blob_store
from tests.registry.adapter_manager_helpers import CountingStore, make_manager
from tests.registry.helpers import version_fields

REPO_ROOT = Path(__file__).resolve().parents[2]
PAUSE_S = 1.0  # how long the deleter is held between its count and its delete
TIMEOUT_S = 30.0  # nothing here may hang: every wait is bounded


class PausingStore(CountingStore):
    """Holds the first ``delete`` until ``go`` is set (``entered`` says it got there)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.entered = threading.Event()
        self.go = threading.Event()
        self.armed = True

    def delete(self, key):
        if self.armed:
            self.armed = False
            self.entered.set()
            if not self.go.wait(TIMEOUT_S):
                raise TimeoutError("test never released the paused delete")
        self.inner.delete(key)


def _run(target) -> tuple[threading.Thread, list]:
    outcome: list = []

    def body():
        try:
            outcome.append(("ok", target()))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            outcome.append(("error", exc))

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, outcome


def _assert_served(registry, blobs, adapters, tmp_path, version) -> None:
    """The version row is live, its blob is in the store, and a fresh process fetches and
    verifies it."""
    spec, dirs = adapters
    assert registry.resolve(version.tenant, version.ref).sha256 == version.sha256
    assert blobs.exists(version.blob_key), "a live version row lost its blob"
    fresh = make_manager(registry, blobs, tmp_path / "fresh-cache", spec)
    ref = fresh.resolve(version.tenant, version.ref)
    assert compute_content_hash(ref.path) == version.sha256 == compute_content_hash(dirs["a"])


@pytest.mark.parametrize("deleter", ["delete_adapter", "collect_garbage"])
def test_upload_racing_a_paused_blob_delete_keeps_its_blob(registry, adapters, tmp_path, deleter):
    spec, dirs = adapters
    blobs = PausingStore(open_blob_store(str(tmp_path / "blobs")))
    manager = make_manager(registry, blobs, tmp_path / "cache", spec)
    old, _ = manager.upload("acme", "old", dirs["a"])
    if deleter == "delete_adapter":
        start_delete = lambda: manager.delete_adapter("acme", "old")  # noqa: E731
    else:
        registry.delete_adapter("acme", "old")  # row gone, blob left behind (a lost deferred delete)
        start_delete = lambda: manager.collect_garbage(min_age_seconds=0)  # noqa: E731

    delete_thread, delete_outcome = _run(start_delete)
    assert blobs.entered.wait(TIMEOUT_S), "the deleter never reached the blob delete"
    # the deleter has counted no live version using the blob and is about to delete it
    upload_thread, upload_outcome = _run(lambda: manager.upload("other", "new", dirs["a"]))
    upload_thread.join(PAUSE_S)
    upload_waited = upload_thread.is_alive()
    blobs.go.set()
    delete_thread.join(TIMEOUT_S)
    upload_thread.join(TIMEOUT_S)
    assert not delete_thread.is_alive() and not upload_thread.is_alive()
    assert delete_outcome[0][0] == "ok", delete_outcome
    assert upload_outcome[0][0] == "ok", upload_outcome
    new, created = upload_outcome[0][1]
    assert created and new.blob_key == old.blob_key == content_key(new.sha256)
    _assert_served(registry, blobs.inner, adapters, tmp_path, new)
    assert upload_waited, "the upload added its row while the blob delete was under way"


def _next_line(lines: queue.Queue, child: subprocess.Popen) -> str:
    try:
        return lines.get(timeout=TIMEOUT_S)
    except queue.Empty:
        child.kill()
        raise AssertionError(f"child said nothing for {TIMEOUT_S}s; stderr:\n{child.stderr.read()}") from None


def test_upload_racing_a_paused_blob_delete_in_another_process(registry, registry_url, adapters, tmp_path):
    """Another server process (sharing the database and the blob directory) deletes the blob."""
    spec, dirs = adapters
    blob_dir = tmp_path / "blobs"
    blobs = open_blob_store(str(blob_dir))
    manager = make_manager(registry, blobs, tmp_path / "cache", spec)
    old, _ = manager.upload("acme", "old", dirs["a"])
    registry.delete_adapter("acme", "old")  # its blob is now unused

    child = subprocess.Popen(
        [sys.executable, "-m", "tests.registry.blob_delete_child", registry_url, str(blob_dir), old.blob_key],
        cwd=REPO_ROOT, env=dict(os.environ), text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.strip()) for line in child.stdout], daemon=True).start()
    try:
        assert _next_line(lines, child) == "deleting"  # counted zero users, holds before the delete
        upload_thread, upload_outcome = _run(lambda: manager.upload("other", "new", dirs["a"]))
        upload_thread.join(PAUSE_S)
        assert upload_thread.is_alive(), "the upload added its row while the other process was deleting the blob"
        child.stdin.write("go\n")
        child.stdin.flush()
        assert _next_line(lines, child) == "deleted True"
        upload_thread.join(TIMEOUT_S)
        assert not upload_thread.is_alive()
    finally:
        child.stdin.close()
        child.wait(timeout=TIMEOUT_S)
    assert child.returncode == 0, child.stderr.read()
    assert upload_outcome[0][0] == "ok", upload_outcome
    new, created = upload_outcome[0][1]
    assert created
    _assert_served(registry, blobs, adapters, tmp_path, new)


def test_upload_after_a_finished_delete_stores_the_blob_again(registry, adapters, tmp_path, monkeypatch):
    """The upload saw the blob, then a delete removed it before the upload took the lock: the
    upload notices under the lock, stores the blob again and retries."""
    spec, dirs = adapters
    blobs = open_blob_store(str(tmp_path / "blobs"))
    manager = make_manager(registry, blobs, tmp_path / "cache", spec)
    old, _ = manager.upload("acme", "old", dirs["a"])
    registry.delete_adapter("acme", "old")
    real_add_version = registry.add_version

    def delete_first(*args, **kwargs):
        monkeypatch.setattr(registry, "add_version", real_add_version)
        assert manager.collect_garbage(min_age_seconds=0) == [old.blob_key]  # between exists() and insert
        return real_add_version(*args, **kwargs)

    monkeypatch.setattr(registry, "add_version", delete_first)
    started = time.monotonic()
    new, created = manager.upload("other", "new", dirs["a"])
    assert created and time.monotonic() - started < 10
    _assert_served(registry, blobs, adapters, tmp_path, new)


def test_add_version_writes_nothing_when_its_blob_is_gone(registry):
    fields = version_fields(b"weights")
    with pytest.raises(BlobMissing):
        registry.add_version("acme", "support", **fields, check_blob=lambda: False)
    assert registry.get_adapter("acme", "support") is None and registry.versions_using_blob(fields["blob_key"]) == 0
    checked = []
    version, created = registry.add_version("acme", "support", **fields, check_blob=lambda: checked.append(1) or True)
    assert created and checked == [1] and version.version == 1  # the failed try used no number


def test_delete_blob_if_unused_deletes_only_unused_blobs(registry):
    fields = version_fields(b"weights")
    registry.add_version("acme", "support", **fields)
    registry.add_version("other", "theirs", **fields)
    calls = []
    assert registry.delete_blob_if_unused(fields["blob_key"], lambda: calls.append(1)) is False
    registry.delete_adapter("acme", "support")
    assert registry.delete_blob_if_unused(fields["blob_key"], lambda: calls.append(1)) is False
    registry.delete_adapter("other", "theirs")

    def failing_delete():
        raise OSError("store down")

    with pytest.raises(OSError):
        registry.delete_blob_if_unused(fields["blob_key"], failing_delete)
    assert registry.delete_blob_if_unused(fields["blob_key"], lambda: calls.append(1)) is True
    assert calls == [1]
