"""AdapterManager on SQLite and PostgreSQL, with the local store and moto's S3 server."""

from __future__ import annotations

import io
import os
import threading
import time

import pytest

from loraplex.lora.errors import InvalidAdapterError
from loraplex.registry.adapter_manager import AdapterManager
from loraplex.lora.peft_format import compute_content_hash
from loraplex.registry.errors import InvalidName, NotFound
from loraplex.storage.archive import pack_files
from loraplex.storage.base import (
    BlobIntegrityError,
    BlobNotFound,
    BlobStoreUnavailable,
    content_key,
    open_blob_store,
)
from loraplex.storage.s3 import S3BlobStore
from tests.registry.adapter_manager_helpers import (
    CountingStore,
    files_digest,
    make_manager,
)
from tests.storage.flaky_proxy import FlakyProxy

FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(params=["local", "s3"])
def blobs(request, tmp_path):
    if request.param == "local":
        return open_blob_store(str(tmp_path / "blobs"))
    return open_blob_store(request.getfixturevalue("s3_blob_url"))


def test_upload_then_resolve_fetches_verified_files(registry, blobs, adapters, tmp_path):
    spec, dirs = adapters
    manager = make_manager(registry, blobs, tmp_path / "cache", spec)
    v1, created = manager.upload("acme", "support", dirs["a"], uploader="alice")
    assert created and v1.version == 1 and v1.sha256 == compute_content_hash(dirs["a"])
    assert (v1.rank, v1.base_model, v1.uploader) == (4, spec.model_name, "alice")
    assert blobs.exists(content_key(v1.sha256)) and v1.blob_key == content_key(v1.sha256)
    again, created_again = manager.upload("acme", "support", dirs["a"])
    assert not created_again and again.version == 1
    v2, _ = manager.upload("acme", "support", dirs["b"])
    assert v2.version == 2

    ref = manager.resolve("acme", "support")  # active: version 1
    assert ref.name == "support@1" and ref.content_hash == v1.sha256
    assert files_digest(ref.path) == {n: files_digest(dirs["a"])[n] for n in FILES}
    assert manager.stats()["fetches"] == 1 and manager.tier_of(v1.sha256) == "disk"
    assert manager.resolve("acme", "support").path == ref.path and manager.stats()["fetches"] == 1
    ref2 = manager.resolve("acme", "support@2")
    assert compute_content_hash(ref2.path) == v2.sha256 and manager.tier_of(v2.sha256) == "disk"

    # Another process (fresh disk cache) fetches from the blob store.
    other = make_manager(registry, blobs, tmp_path / "cache2", spec)
    assert other.tier_of(v2.sha256) == "store"
    assert files_digest(other.resolve("acme", "support@2").path) == files_digest(ref2.path)


@pytest.mark.parametrize(
    "which,message", [("big", "above this engine's max_lora_rank"), ("wrong", "shape")]
)
def test_invalid_adapter_stores_nothing(registry, adapters, tmp_path, which, message):
    spec, dirs = adapters
    blobs = open_blob_store(str(tmp_path / "blobs"))
    manager = make_manager(registry, blobs, tmp_path / "cache", spec)
    with pytest.raises(InvalidAdapterError, match=message):
        manager.upload("acme", "x", dirs[which])
    assert registry.get_adapter("acme", "x") is None
    assert not list((tmp_path / "blobs").glob("sha256/*"))


def test_bad_names_and_missing_tenant_store_nothing(registry, adapters, tmp_path):
    spec, dirs = adapters
    blobs = open_blob_store(str(tmp_path / "blobs"))
    manager = make_manager(registry, blobs, tmp_path / "cache", spec)
    for tenant, name, error in [("acme", "../x", InvalidName), ("../acme", "x", InvalidName), ("nobody", "x", NotFound)]:
        with pytest.raises(error):
            manager.upload(tenant, name, dirs["a"])
    assert not list((tmp_path / "blobs").glob("sha256/*"))


def test_crash_between_blob_put_and_row_insert(registry, blobs, adapters, tmp_path, monkeypatch):
    spec, dirs = adapters
    manager = make_manager(registry, blobs, tmp_path / "cache", spec)
    key = content_key(compute_content_hash(dirs["a"]))

    def crash(*args, **kwargs):
        assert blobs.exists(key)  # the blob went in first
        raise RuntimeError("process killed")

    monkeypatch.setattr(registry, "add_version", crash)
    with pytest.raises(RuntimeError, match="killed"):
        manager.upload("acme", "support", dirs["a"])
    monkeypatch.undo()
    assert registry.get_adapter("acme", "support") is None and registry.list_adapters("acme") == []
    with pytest.raises(NotFound):
        manager.resolve("acme", "support")
    assert not blobs.exists(key)  # the orphan this upload created was removed
    # A retry works normally.
    version, created = manager.upload("acme", "support", dirs["a"])
    assert created and version.version == 1 and blobs.exists(key)


def test_crash_does_not_remove_a_blob_others_use(registry, adapters, tmp_path, monkeypatch):
    spec, dirs = adapters
    blobs = open_blob_store(str(tmp_path / "blobs"))
    manager = make_manager(registry, blobs, tmp_path / "cache", spec)
    v, _ = manager.upload("other", "shared", dirs["a"])
    monkeypatch.setattr(registry, "add_version", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError):
        manager.upload("acme", "mine", dirs["a"])
    monkeypatch.undo()
    assert blobs.exists(v.blob_key)
    assert compute_content_hash(manager.resolve("other", "shared").path) == v.sha256


def _write_blob(blobs, key, src_dir):
    buf = io.BytesIO()
    size = pack_files(src_dir, FILES, buf)
    buf.seek(0)
    blobs.put(key, buf, size)


@pytest.mark.parametrize("corruption", ["other_weights", "garbage"])
def test_corrupted_blob_is_detected_and_not_used(registry, blobs, adapters, tmp_path, corruption):
    spec, dirs = adapters
    manager = make_manager(registry, blobs, tmp_path / "cache", spec)
    v, _ = manager.upload("acme", "support", dirs["a"])
    if corruption == "other_weights":
        _write_blob(blobs, v.blob_key, dirs["b"])  # a valid archive of different weights
    else:
        blobs.put(v.blob_key, io.BytesIO(b"\x00not a tar" * 100), 1000)
    with pytest.raises(BlobIntegrityError, match="failed verification"):
        manager.resolve("acme", "support")
    assert manager.tier_of(v.sha256) == "store" and manager.stats()["integrity_errors"] == 1
    assert not list((tmp_path / "cache" / "staging").iterdir())
    events = [e for e in registry.list_audit("acme") if e.action == "blob.integrity_error"]
    assert len(events) == 1 and events[0].object_name == "support@1"
    # Once the blob is repaired the same manager serves it.
    _write_blob(blobs, v.blob_key, dirs["a"])
    assert compute_content_hash(manager.resolve("acme", "support").path) == v.sha256


def test_corrupted_disk_copy_is_refetched(registry, adapters, tmp_path):
    spec, dirs = adapters
    blobs = open_blob_store(str(tmp_path / "blobs"))
    manager = make_manager(registry, blobs, tmp_path / "cache", spec)
    v, _ = manager.upload("acme", "support", dirs["a"])
    path = manager.resolve("acme", "support").path
    weights = f"{path}/adapter_model.safetensors"
    data = bytearray(open(weights, "rb").read())
    data[-1] ^= 0xFF
    open(weights, "wb").write(bytes(data))
    restarted = make_manager(registry, blobs, tmp_path / "cache", spec)  # verifies on first use
    assert compute_content_hash(restarted.resolve("acme", "support").path) == v.sha256
    assert restarted.stats()["fetches"] == 1


def test_s3_outage_during_fetch_then_recovery(registry, adapters, tmp_path, moto_server, s3_bucket):
    spec, dirs = adapters
    direct = S3BlobStore(s3_bucket, "blobs", endpoint_url=moto_server)
    make_manager(registry, direct, tmp_path / "up", spec).upload("acme", "support", dirs["a"])
    with FlakyProxy(moto_server) as proxy:
        flaky = S3BlobStore(
            s3_bucket, "blobs", endpoint_url=proxy.url, max_attempts=2, read_retries=1, retry_backoff=0.01
        )
        manager = make_manager(registry, flaky, tmp_path / "cache", spec)
        proxy.mode = "cut"
        with pytest.raises(BlobStoreUnavailable, match="download broke"):
            manager.resolve("acme", "support")
        assert manager.tier_of(compute_content_hash(dirs["a"])) == "store"
        assert not list((tmp_path / "cache" / "staging").iterdir())
        proxy.mode = "error503"
        with pytest.raises(BlobStoreUnavailable, match="503"):
            manager.resolve("acme", "support")
        proxy.mode = "pass"
        ref = manager.resolve("acme", "support")
        assert files_digest(ref.path) == {n: files_digest(dirs["a"])[n] for n in FILES}


def test_concurrent_resolves_fetch_once(registry, adapters, tmp_path):
    spec, dirs = adapters
    blobs = CountingStore(open_blob_store(str(tmp_path / "blobs")), delay=0.3)
    manager = make_manager(registry, blobs, tmp_path / "cache", spec)
    v, _ = manager.upload("acme", "support", dirs["a"])
    results, errors = [], []
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        try:
            results.append(manager.resolve("acme", "support").path)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1 and len(results) == 8
    assert blobs.gets == 1 and compute_content_hash(results[0]) == v.sha256


def test_failed_single_flight_fetch_is_retried_later(registry, adapters, tmp_path):
    spec, dirs = adapters
    blobs = CountingStore(open_blob_store(str(tmp_path / "blobs")), delay=0.2)
    manager = make_manager(registry, blobs, tmp_path / "cache", spec)
    manager.upload("acme", "support", dirs["a"])
    blobs.fail = BlobStoreUnavailable("store down")
    errors = []

    def worker():
        try:
            manager.resolve("acme", "support")
        except BlobStoreUnavailable as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 4 and blobs.gets < 4  # followers shared the leader's failure
    blobs.fail = None
    assert manager.resolve("acme", "support").content_hash == compute_content_hash(dirs["a"])


def test_delete_in_use_version_waits_for_release(registry, blobs, adapters, tmp_path):
    spec, dirs = adapters
    manager = make_manager(registry, blobs, tmp_path / "cache", spec)
    v1, _ = manager.upload("acme", "support", dirs["a"])
    v2, _ = manager.upload("acme", "support", dirs["b"])
    ref = manager.resolve("acme", "support@1", acquire=True)  # a running request
    manager.registry.activate("acme", "support", 2)
    manager.delete_version("acme", "support", 1)
    with pytest.raises(NotFound):
        manager.resolve("acme", "support@1")  # no new request can use it
    assert blobs.exists(v1.blob_key) and compute_content_hash(ref.path) == v1.sha256  # still readable
    manager.release(ref.content_hash)
    assert not blobs.exists(v1.blob_key) and manager.tier_of(v1.sha256) == "store"
    assert blobs.exists(v2.blob_key)


def test_deferred_delete_in_the_background_does_not_block_release(registry, adapters, tmp_path):
    """The server releases on its event loop: with background deletes, the last release returns
    while the store delete is still held, and the blob goes once it proceeds."""
    from tests.registry.test_blob_delete_race import PausingStore

    spec, dirs = adapters
    blobs = PausingStore(open_blob_store(str(tmp_path / "blobs")))
    manager = AdapterManager(
        registry, blobs, AdapterManager.make_disk_cache(tmp_path / "cache", 1 << 30), spec, 64,
        background_deletes=True,
    )
    v1, _ = manager.upload("acme", "support", dirs["a"])
    ref = manager.resolve("acme", "support", acquire=True)
    manager.delete_adapter("acme", "support")
    started = time.monotonic()
    manager.release(ref.content_hash)
    assert time.monotonic() - started < 0.5 and blobs.entered.wait(10)  # the delete waits, release did not
    assert blobs.exists(v1.blob_key)
    blobs.go.set()
    deadline = time.monotonic() + 10
    # the store delete, then the local copy
    while (blobs.exists(v1.blob_key) or manager.tier_of(v1.sha256) != "store") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not blobs.exists(v1.blob_key) and manager.tier_of(v1.sha256) == "store"


def test_delete_keeps_blob_shared_with_another_version(registry, adapters, tmp_path):
    spec, dirs = adapters
    blobs = open_blob_store(str(tmp_path / "blobs"))
    manager = make_manager(registry, blobs, tmp_path / "cache", spec)
    mine, _ = manager.upload("acme", "mine", dirs["a"])
    theirs, _ = manager.upload("other", "theirs", dirs["a"])
    assert mine.blob_key == theirs.blob_key
    with manager.lease("acme", "mine") as ref:
        assert manager.in_use(ref.content_hash) == 1
        manager.delete_adapter("acme", "mine")
    assert manager.in_use(mine.sha256) == 0
    assert blobs.exists(theirs.blob_key)  # still used by the other tenant's version
    manager.delete_adapter("other", "theirs")
    assert not blobs.exists(theirs.blob_key)


def test_acquired_entries_survive_disk_pressure(registry, adapters, tmp_path):
    spec, dirs = adapters
    blobs = open_blob_store(str(tmp_path / "blobs"))
    sizes = [sum(p.stat().st_size for p in dirs[n].iterdir() if p.name in FILES) for n in ("a", "b")]
    manager = make_manager(registry, blobs, tmp_path / "cache", spec, max_disk_bytes=max(sizes) + 10)
    manager.upload("acme", "a", dirs["a"])
    manager.upload("acme", "b", dirs["b"])
    with manager.lease("acme", "a") as ref_a:
        ref_b = manager.resolve("acme", "b")  # over budget, but a is in use
        assert manager.tier_of(ref_a.content_hash) == "disk" and compute_content_hash(ref_a.path) == ref_a.content_hash
    # released: a is the least recently used and goes
    assert manager.tier_of(ref_a.content_hash) == "store" and manager.tier_of(ref_b.content_hash) == "disk"


def test_garbage_collection_of_crash_leftovers(registry, blobs, adapters, tmp_path, monkeypatch):
    spec, dirs = adapters
    manager = make_manager(registry, blobs, tmp_path / "cache", spec)
    kept, _ = manager.upload("acme", "kept", dirs["b"])
    # 1. crash between blob put and row insert, and the cleanup never ran (process died)
    monkeypatch.setattr(registry, "add_version", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("killed")))
    monkeypatch.setattr(manager, "_delete_blob_if_unused", lambda *a: None)
    with pytest.raises(RuntimeError):
        manager.upload("acme", "orphan", dirs["a"])
    monkeypatch.undo()
    orphan_key = content_key(compute_content_hash(dirs["a"]))
    assert blobs.exists(orphan_key)
    assert manager.collect_garbage(min_age_seconds=3600) == []  # too young: might be an upload in progress
    assert manager.collect_garbage(min_age_seconds=0) == [orphan_key]
    assert not blobs.exists(orphan_key) and blobs.exists(kept.blob_key)


def test_garbage_collection_removes_a_killed_puts_temporary_file(registry, adapters, tmp_path):
    """A process killed during a local put leaves ``.tmp/<random>.part``, which no key names:
    the collection removes it once older than its age limit (a younger one may be a put
    running now), and leaves blobs alone."""
    spec, dirs = adapters
    blobs = open_blob_store(str(tmp_path / "blobs"))
    manager = make_manager(registry, blobs, tmp_path / "cache", spec)
    kept, _ = manager.upload("acme", "kept", dirs["b"])
    stale, fresh = tmp_path / "blobs" / ".tmp" / "dead.part", tmp_path / "blobs" / ".tmp" / "running.part"
    for path in (stale, fresh):
        path.write_bytes(b"half a blob")
    two_hours_ago = time.time() - 7200
    os.utime(stale, (two_hours_ago, two_hours_ago))
    assert manager.collect_garbage(min_age_seconds=3600) == []  # no blob deleted
    assert not stale.exists() and fresh.exists() and blobs.exists(kept.blob_key)


def test_garbage_collection_after_deferred_delete_was_lost(registry, adapters, tmp_path):
    spec, dirs = adapters
    blobs = open_blob_store(str(tmp_path / "blobs"))
    first = make_manager(registry, blobs, tmp_path / "cache", spec)
    v, _ = first.upload("acme", "support", dirs["a"])
    first.resolve("acme", "support", acquire=True)
    first.delete_adapter("acme", "support")  # deferred: a request is running...
    assert blobs.exists(v.blob_key)  # ...and then the process dies without releasing
    restarted = make_manager(registry, blobs, tmp_path / "cache", spec)
    assert restarted.collect_garbage(min_age_seconds=0) == [v.blob_key]
    assert not blobs.exists(v.blob_key) and restarted.tier_of(v.sha256) == "store"


def test_version_deleted_during_resolve_is_not_found(registry, adapters, tmp_path, monkeypatch):
    spec, dirs = adapters
    blobs = open_blob_store(str(tmp_path / "blobs"))
    manager = make_manager(registry, blobs, tmp_path / "cache", spec)
    manager.upload("acme", "support", dirs["a"])
    real_resolve = registry.resolve

    def resolve_then_delete(tenant, ref):
        version = real_resolve(tenant, ref)
        monkeypatch.setattr(registry, "resolve", real_resolve)
        manager.delete_adapter(tenant, "support")  # another admin, right after our lookup
        return version

    monkeypatch.setattr(registry, "resolve", resolve_then_delete)
    with pytest.raises(NotFound):
        manager.resolve("acme", "support")
    # a store that really lost a blob of a live version is a blob error
    v, _ = manager.upload("acme", "other", dirs["b"])
    blobs.delete(v.blob_key)
    with pytest.raises(BlobNotFound, match="not found in directory"):
        manager.resolve("acme", "other")
