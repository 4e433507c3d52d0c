"""Shared setup for the AdapterManager tests: a tiny base model, PEFT adapters made by peft, and
a manager on a given registry and blob store."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

from loraplex.registry.adapter_manager import AdapterManager
from loraplex.storage.base import BlobStore
from tests.fixtures.peft_adapters import make_peft_adapter, spec_for, tiny_llama

MAX_RANK = 16


def build_adapters(root: Path) -> tuple[object, dict[str, Path]]:
    """A tiny base's spec and a few adapters for it: a, b (other weights), big (rank 32), and
    wrong (made for a base with another hidden size)."""
    base = tiny_llama(seed=11)
    adapters = {
        "a": make_peft_adapter(base, root / "a", seed=1, r=4),
        "b": make_peft_adapter(base, root / "b", seed=2, r=8, target_modules=["q_proj", "down_proj"]),
        "big": make_peft_adapter(base, root / "big", seed=3, r=32),
        "wrong": make_peft_adapter(tiny_llama(seed=0, hidden_size=32, intermediate_size=48), root / "wrong", seed=4),
    }
    return spec_for(base), adapters


def make_manager(registry, blobs: BlobStore, cache_dir: Path, spec, max_disk_bytes: int = 1 << 30) -> AdapterManager:
    return AdapterManager(registry, blobs, AdapterManager.make_disk_cache(cache_dir, max_disk_bytes), spec, MAX_RANK)


def files_digest(path: str | Path) -> dict[str, str]:
    """sha256 of each file in a directory, by name (compares copies byte for byte)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(path).iterdir())}


class CountingStore(BlobStore):
    """Wraps a store: counts gets, can slow them down or fail them."""

    def __init__(self, inner: BlobStore, delay: float = 0.0):
        self.inner = inner
        self.delay = delay
        self.fail: Exception | None = None
        self.gets = 0
        self._lock = threading.Lock()

    def put(self, key, stream, size):
        self.inner.put(key, stream, size)

    def get(self, key, chunk_bytes=1 << 20):
        with self._lock:
            self.gets += 1
        time.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        return self.inner.get(key, chunk_bytes)

    def exists(self, key):
        return self.inner.exists(key)

    def delete(self, key):
        self.inner.delete(key)

    def list_blobs(self, prefix="sha256/"):
        return self.inner.list_blobs(prefix)

    def describe(self):
        return "counting " + self.inner.describe()
