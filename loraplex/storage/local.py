"""A blob store in a local directory (the embedded default, ``$LORAPLEX_HOME/blobs``)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from loraplex.storage.base import (
    DEFAULT_CHUNK_BYTES,
    BlobEntry,
    BlobIntegrityError,
    BlobNotFound,
    BlobStore,
    check_key,
)
from loraplex.storage.durable import fsync_directory

_TMP_DIR = ".tmp"  # not a valid first key segment, so it never collides with a blob


class LocalBlobStore(BlobStore):
    """Blobs as files under ``root/<key>``. A put writes ``root/.tmp/<random>``, fsyncs it and
    renames it onto the final path, so a crash leaves at most a stray temp file, never a partial
    blob under its key."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser()
        (self.root / _TMP_DIR).mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def put(self, key: str, stream: BinaryIO, size: int) -> None:
        final = self._path(key)
        tmp = self.root / _TMP_DIR / f"{uuid.uuid4().hex}.part"
        written = 0
        try:
            with open(tmp, "wb") as out:
                while True:
                    chunk = stream.read(min(DEFAULT_CHUNK_BYTES, size - written + 1))
                    if not chunk:
                        break
                    written += len(chunk)
                    if written > size:
                        raise BlobIntegrityError(
                            f"blob {key}: stream holds more than the declared {size} bytes"
                        )
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            if written != size:
                raise BlobIntegrityError(
                    f"blob {key}: stream ended after {written} of the declared {size} bytes"
                )
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, final)
            fsync_directory(final.parent)  # the rename is durable once the entry is on disk
        finally:
            tmp.unlink(missing_ok=True)

    def get(self, key: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
        path = self._path(key)
        try:
            handle = open(path, "rb")
        except FileNotFoundError:
            raise BlobNotFound(f"blob {key} not found in {self.describe()}") from None
        return _read_chunks(handle, chunk_bytes)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def list_blobs(self, prefix: str = "sha256/") -> Iterator[BlobEntry]:
        for path in sorted(self.root.rglob("*")):
            relative = path.relative_to(self.root)
            if relative.parts[0] == _TMP_DIR or not path.is_file():
                continue
            key = "/".join(relative.parts)
            if key.startswith(prefix):
                stat = path.stat()
                yield BlobEntry(key, stat.st_size, stat.st_mtime)

    def describe(self) -> str:
        return f"directory {self.root}"

    def sweep_partial_puts(self, min_age_seconds: float) -> int:
        cutoff = time.time() - min_age_seconds
        removed = 0
        for path in (self.root / _TMP_DIR).glob("*.part"):
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:  # its put finished (or another sweep took it) meanwhile
                continue
        return removed


def _read_chunks(handle: BinaryIO, chunk_bytes: int) -> Iterator[bytes]:
    with handle:
        while chunk := handle.read(chunk_bytes):
            yield chunk
