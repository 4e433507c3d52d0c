"""DiskCache: integrity on insert and after restart, LRU within a byte budget, pins."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest

from loraplex.storage.disk_cache import CacheIntegrityError, CacheTooSmallError, DiskCache


def dir_hash(path: Path) -> str:
    """A stand-in identity: sha256 over (name, bytes) of each file, sorted."""
    h = hashlib.sha256()
    for f in sorted(Path(path).iterdir()):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def stage(cache: DiskCache, payload: bytes) -> tuple[Path, str]:
    d = cache.new_staging_dir()
    (d / "weights").write_bytes(payload)
    return d, dir_hash(d)


def add(cache: DiskCache, payload: bytes) -> str:
    d, h = stage(cache, payload)
    cache.insert(h, d)
    return h


def test_insert_get_roundtrip(tmp_path):
    cache = DiskCache(tmp_path, 10_000, dir_hash)
    d, h = stage(cache, b"abc")
    path = cache.insert(h, d)
    assert not d.exists()
    assert cache.get(h) == path and (path / "weights").read_bytes() == b"abc"
    assert cache.get("f" * 64) is None


def test_insert_refuses_mismatch(tmp_path):
    cache = DiskCache(tmp_path, 10_000, dir_hash)
    d, _ = stage(cache, b"abc")
    wrong = "0" * 64
    with pytest.raises(CacheIntegrityError, match="expected"):
        cache.insert(wrong, d)
    assert not d.exists() and cache.get(wrong) is None and not cache.path_of(wrong).exists()


def test_insert_refuses_unreadable(tmp_path):
    def broken(path):
        raise ValueError("bad safetensors header")

    cache = DiskCache(tmp_path, 10_000, broken)
    d = cache.new_staging_dir()
    with pytest.raises(CacheIntegrityError, match="bad safetensors header"):
        cache.insert("a" * 64, d)
    assert cache.stats()["entries"] == 0


def test_lru_eviction_within_budget(tmp_path):
    cache = DiskCache(tmp_path, 3000, dir_hash)
    a, b, c = (add(cache, bytes([i]) * 1000) for i in range(3))
    assert cache.get(a) is not None  # a is now most recently used; b is the oldest
    d = add(cache, b"d" * 1000)
    assert cache.get(b) is None and not cache.path_of(b).exists()
    assert all(cache.get(x) is not None for x in (a, c, d))
    assert cache.total_bytes == 3000 and cache.stats()["evictions"] == 1


def test_pinned_entries_are_not_evicted(tmp_path):
    cache = DiskCache(tmp_path, 2000, dir_hash)
    a = add(cache, b"a" * 1000)
    b = add(cache, b"b" * 1000)
    cache.pin(a)
    cache.pin(b)
    c = add(cache, b"c" * 1000)  # nothing evictable: over budget for now
    assert all(cache.contains(x) for x in (a, b, c))
    assert cache.total_bytes == 3000
    cache.unpin(a)  # a becomes evictable and is the least recently used
    assert not cache.contains(a) and cache.total_bytes == 2000
    assert not cache.remove(b) and cache.contains(b)  # pinned: remove refuses
    cache.unpin(b)
    assert cache.remove(b) and not cache.contains(b)


def test_entry_bigger_than_budget(tmp_path):
    cache = DiskCache(tmp_path, 100, dir_hash)
    d, h = stage(cache, b"x" * 101)
    with pytest.raises(CacheTooSmallError, match="max_disk_lora_bytes"):
        cache.insert(h, d)
    assert not d.exists()


def test_restart_adopts_entries_and_detects_corruption(tmp_path):
    cache = DiskCache(tmp_path, 10_000, dir_hash)
    good = add(cache, b"good")
    bad = add(cache, b"bad!")
    (cache.path_of(bad) / "weights").write_bytes(b"evil")  # tampered while stopped
    reopened = DiskCache(tmp_path, 10_000, dir_hash)
    assert reopened.total_bytes == 8
    assert reopened.get(good) is not None
    assert reopened.get(bad) is None and not reopened.path_of(bad).exists()


def test_restart_keeps_lru_order(tmp_path):
    cache = DiskCache(tmp_path, 2000, dir_hash)
    a = add(cache, b"a" * 1000)
    b = add(cache, b"b" * 1000)
    import os, time

    old = time.time() - 100
    os.utime(cache.path_of(b), (old, old))  # b used long ago, a recently
    reopened = DiskCache(tmp_path, 2000, dir_hash)
    add(reopened, b"c" * 1000)
    assert reopened.contains(a) and not reopened.contains(b)


def test_concurrent_inserts_of_same_entry(tmp_path):
    cache = DiskCache(tmp_path, 10_000, dir_hash)
    errors = []

    def worker():
        try:
            d, h = stage(cache, b"same")
            cache.insert(h, d)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert cache.stats()["entries"] == 1 and list((tmp_path / "staging").iterdir()) == []
