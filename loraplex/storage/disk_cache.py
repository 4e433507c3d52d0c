"""Local disk cache of adapter directories, keyed by content hash, with a byte budget.

Layout under ``root``: ``entries/<content_hash>/`` (the adapter files), ``staging/`` (where
producers build a directory before ``insert`` renames it into place, same file system so the
rename is atomic) and ``trash/`` (evicted directories are renamed there before removal, so a
reader never sees a half-deleted entry under its key).

* Integrity: ``insert`` recomputes the hash of the staged directory with ``verify`` and refuses a
  mismatch. Entries found on disk from an earlier run are verified again on first use.
* LRU within ``max_bytes``; entries pinned (``pin``/``unpin``, counted) are never evicted. If
  pinned entries alone exceed the budget, the cache stays over budget until they are unpinned.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path

from loraplex.storage.base import BlobIntegrityError, BlobStoreError

log = logging.getLogger(__name__)
STALE_STAGING_SECONDS = 3600


class CacheIntegrityError(BlobIntegrityError):
    """A directory does not hash to the content hash it is filed under."""


class CacheTooSmallError(BlobStoreError):
    """An entry larger than the whole cache budget."""


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


class DiskCache:
    """Adapter directories by content hash; see the module docstring.

    ``verify(path) -> content_hash`` computes the identity of a directory (the adapter manager
    passes ``loraplex.lora.peft_format.compute_content_hash``); it may raise for unreadable
    files, which counts as a mismatch. Thread-safe.
    """

    def __init__(self, root: str | os.PathLike, max_bytes: int, verify: Callable[[Path], str]):
        self.root = Path(root).expanduser()
        self.max_bytes = int(max_bytes)
        self._verify = verify
        self._entries_dir = self.root / "entries"
        self._staging = self.root / "staging"
        self._trash = self.root / "trash"
        for d in (self._entries_dir, self._staging, self._trash):
            d.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._lru: OrderedDict[str, int] = OrderedDict()  # content hash -> bytes, least recent first
        self._verified: set[str] = set()
        self._pins: Counter[str] = Counter()
        self.evictions = 0
        self._cleanup_leftovers()
        self._adopt_existing()

    # -- startup -------------------------------------------------------------------------------

    def _cleanup_leftovers(self) -> None:
        for path in self._trash.iterdir():
            shutil.rmtree(path, ignore_errors=True)
        cutoff = time.time() - STALE_STAGING_SECONDS  # other processes may be staging right now
        for path in self._staging.iterdir():
            if path.stat().st_mtime < cutoff:
                shutil.rmtree(path, ignore_errors=True)

    def _adopt_existing(self) -> None:
        found = []
        for path in self._entries_dir.iterdir():
            if path.is_dir():
                found.append((path.stat().st_mtime, path.name, _dir_bytes(path)))
        for _, name, size in sorted(found):  # oldest use first
            self._lru[name] = size

    # -- queries -------------------------------------------------------------------------------

    def path_of(self, content_hash: str) -> Path:
        return self._entries_dir / content_hash

    def contains(self, content_hash: str) -> bool:
        with self._lock:
            return content_hash in self._lru

    def content_hashes(self) -> list[str]:
        """The entries' content hashes, least recently used first (a snapshot)."""
        with self._lock:
            return list(self._lru)

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return sum(self._lru.values())

    def stats(self) -> dict:
        with self._lock:
            return {
                "entries": len(self._lru),
                "bytes": sum(self._lru.values()),
                "max_bytes": self.max_bytes,
                "pinned": sum(1 for c in self._pins.values() if c > 0),
                "evictions": self.evictions,
            }

    def get(self, content_hash: str) -> Path | None:
        """The entry's directory (marked most recently used), or None. An entry not yet verified
        in this process is verified first; a corrupt one is removed and None returned."""
        path = self.path_of(content_hash)
        with self._lock:
            if content_hash not in self._lru and path.is_dir():
                self._lru[content_hash] = _dir_bytes(path)  # put there by another process
            if content_hash not in self._lru:
                return None
            if not path.is_dir():
                del self._lru[content_hash]
                return None
            verified = content_hash in self._verified
        if not verified and not self._matches(path, content_hash):
            log.error("disk cache entry %s is corrupt; removing it", content_hash)
            self.remove(content_hash, force=True)
            return None
        with self._lock:
            self._verified.add(content_hash)
            if content_hash in self._lru:
                self._lru.move_to_end(content_hash)
        try:
            os.utime(path)  # LRU order survives a restart
        except OSError:
            pass
        return path

    def _matches(self, path: Path, content_hash: str) -> bool:
        try:
            return self._verify(path) == content_hash
        except Exception as exc:  # noqa: BLE001 - unreadable files are a mismatch
            log.error("verifying %s failed: %s", path, exc)
            return False

    # -- changes -------------------------------------------------------------------------------

    def new_staging_dir(self) -> Path:
        """An empty directory on the cache's file system, to build an entry in."""
        return Path(tempfile.mkdtemp(prefix="stage-", dir=self._staging))

    def insert(self, content_hash: str, staged_dir: str | os.PathLike) -> Path:
        """Verify ``staged_dir`` hashes to ``content_hash`` and move it into the cache (the
        staged directory is consumed either way). Returns the entry's directory."""
        staged = Path(staged_dir)
        try:
            computed = self._verify(staged)
        except Exception as exc:  # noqa: BLE001
            shutil.rmtree(staged, ignore_errors=True)
            raise CacheIntegrityError(f"adapter files for {content_hash} are unreadable: {exc}") from exc
        if computed != content_hash:
            shutil.rmtree(staged, ignore_errors=True)
            raise CacheIntegrityError(f"adapter files hash to {computed}, expected {content_hash}")
        size = _dir_bytes(staged)
        if size > self.max_bytes:
            shutil.rmtree(staged, ignore_errors=True)
            raise CacheTooSmallError(
                f"adapter {content_hash} has {size} bytes, more than the whole disk cache budget "
                f"({self.max_bytes} bytes, max_disk_lora_bytes)"
            )
        final = self.path_of(content_hash)
        with self._lock:
            try:
                os.rename(staged, final)
            except OSError:
                if not final.is_dir():
                    shutil.rmtree(staged, ignore_errors=True)
                    raise
                shutil.rmtree(staged, ignore_errors=True)  # another process put the same entry
            self._lru[content_hash] = size
            self._lru.move_to_end(content_hash)
            self._verified.add(content_hash)
            self._evict_to_fit(keep=content_hash)
        return final

    def pin(self, content_hash: str) -> None:
        with self._lock:
            self._pins[content_hash] += 1

    def unpin(self, content_hash: str) -> None:
        with self._lock:
            if self._pins[content_hash] <= 1:
                self._pins.pop(content_hash, None)
                self._evict_to_fit()
            else:
                self._pins[content_hash] -= 1

    def is_pinned(self, content_hash: str) -> bool:
        with self._lock:
            return self._pins.get(content_hash, 0) > 0

    def remove(self, content_hash: str, force: bool = False) -> bool:
        """Drop an entry; a pinned one only with ``force``. Returns whether it was removed."""
        with self._lock:
            if self._pins.get(content_hash, 0) > 0 and not force:
                return False
            self._lru.pop(content_hash, None)
            self._verified.discard(content_hash)
            self._discard_dir(self.path_of(content_hash))
            return True

    def _evict_to_fit(self, keep: str | None = None) -> None:
        total = sum(self._lru.values())
        for victim in list(self._lru):
            if total <= self.max_bytes:
                break
            if victim == keep or self._pins.get(victim, 0) > 0:
                continue
            total -= self._lru.pop(victim)
            self._verified.discard(victim)
            self._discard_dir(self.path_of(victim))
            self.evictions += 1
            log.info("disk cache evicted %s", victim)
        if total > self.max_bytes:
            log.warning("disk cache over budget (%d > %d bytes): remaining entries are in use", total, self.max_bytes)

    def _discard_dir(self, path: Path) -> None:
        trash = self._trash / uuid.uuid4().hex
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)
