"""Blob store behaviour, the same tests on the local directory store and on S3 (moto server)."""

from __future__ import annotations

import hashlib
import io
import os
import time

import pytest

from loraplex.storage.base import (
    BlobIntegrityError,
    BlobNotFound,
    check_key,
    content_key,
    open_blob_store,
)
from loraplex.storage.local import LocalBlobStore
from loraplex.storage.s3 import S3BlobStore


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return open_blob_store(str(tmp_path / "blobs"))
    url = request.getfixturevalue("s3_blob_url")
    return open_blob_store(url)


def _blob(size: int, seed: int = 0) -> bytes:
    return os.urandom(size) if seed < 0 else hashlib.sha256(str(seed).encode()).digest() * (size // 32) + b"x" * (size % 32)


def _key(data: bytes) -> str:
    return content_key(hashlib.sha256(data).hexdigest())


def test_put_get_exists_delete_roundtrip(store):
    data = os.urandom(3 * (1 << 20) + 17)
    key = _key(data)
    assert not store.exists(key)
    store.put(key, io.BytesIO(data), len(data))
    assert store.exists(key)
    assert b"".join(store.get(key, chunk_bytes=256 * 1024)) == data
    store.delete(key)
    assert not store.exists(key)
    store.delete(key)  # deleting a missing key is fine


def test_get_missing_raises_at_call(store):
    with pytest.raises(BlobNotFound, match="not found"):
        store.get(content_key("0" * 64))


@pytest.mark.parametrize("declared_delta", [-5, +5])
def test_size_mismatch_stores_nothing(store, declared_delta):
    data = os.urandom(10_000)
    key = _key(data)
    with pytest.raises(BlobIntegrityError, match="declared"):
        store.put(key, io.BytesIO(data), len(data) + declared_delta)
    assert not store.exists(key)


@pytest.mark.parametrize(
    "bad", ["../x", "/sha256/abc", "sha256/../x", "sha256/", "sha256", "sha256/.hidden", "a//b", "A/b", "sha256/a\x00b"]
)
def test_unsafe_keys_rejected(store, bad):
    with pytest.raises(ValueError, match="invalid blob key"):
        store.exists(bad)
    with pytest.raises(ValueError):
        check_key(bad)


def test_content_key_requires_sha256():
    assert content_key("a" * 64) == "sha256/" + "a" * 64
    for bad in ["", "A" * 64, "a" * 63, "../" + "a" * 61]:
        with pytest.raises(ValueError):
            content_key(bad)


def test_open_blob_store_urls(tmp_path, s3_env):
    assert isinstance(open_blob_store(str(tmp_path / "a")), LocalBlobStore)
    local = open_blob_store(f"file://{tmp_path / 'b'}")
    assert isinstance(local, LocalBlobStore) and local.root == tmp_path / "b"
    s3 = open_blob_store("s3://bucket/some/prefix/")
    assert isinstance(s3, S3BlobStore) and (s3.bucket, s3.prefix) == ("bucket", "some/prefix")
    with pytest.raises(ValueError, match="bucket"):
        open_blob_store("s3:///x")
    with pytest.raises(ValueError, match="unsupported"):
        open_blob_store("gs://bucket/x")


class _BrokenStream(io.RawIOBase):
    """Yields some bytes, then fails like a client that went away mid-upload."""

    def __init__(self, good: bytes):
        self._good = io.BytesIO(good)

    def readable(self):
        return True

    def read(self, n=-1):
        chunk = self._good.read(n)
        if not chunk:
            raise OSError("client disconnected")
        return chunk


def test_local_crash_mid_put_leaves_no_blob(tmp_path):
    store = LocalBlobStore(tmp_path / "blobs")
    key = content_key("b" * 64)
    with pytest.raises(OSError, match="disconnected"):
        store.put(key, _BrokenStream(b"x" * 5000), 10_000)
    assert not store.exists(key)
    assert list((tmp_path / "blobs" / ".tmp").iterdir()) == []


def test_local_crash_before_rename_leaves_no_blob(tmp_path, monkeypatch):
    store = LocalBlobStore(tmp_path / "blobs")
    key = content_key("c" * 64)

    def crash(src, dst):
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        store.put(key, io.BytesIO(b"y" * 100), 100)
    monkeypatch.undo()
    assert not store.exists(key)
    # The next put of the same key works normally.
    store.put(key, io.BytesIO(b"y" * 100), 100)
    assert b"".join(store.get(key)) == b"y" * 100


def test_list_blobs(store):
    blobs = {}
    for i in range(3):
        data = os.urandom(100 + i)
        blobs[_key(data)] = len(data)
        store.put(_key(data), io.BytesIO(data), len(data))
    store.put("other/x", io.BytesIO(b"zz"), 2)
    listed = {e.key: e for e in store.list_blobs("sha256/")}
    assert {k: e.size for k, e in listed.items()} == blobs
    assert all(abs(e.modified - time.time()) < 300 for e in listed.values())
