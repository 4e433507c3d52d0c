"""The blob format of a directory of named files: a deterministic, uncompressed tar.

``pack_files`` writes the named files in a fixed order with fixed metadata (mtime 0, owner 0,
mode 0644), so the same files always give the same bytes. ``unpack_files`` reads such a tar from
a stream of chunks into a directory, accepting only regular-file members whose names are in the
expected set (so nothing can land outside the directory: no absolute paths, ``..``, links or
devices), each at most once and under a size cap.
"""

from __future__ import annotations

import io
import shutil
import tarfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO


class ArchiveError(ValueError):
    """The blob is not an archive of exactly the expected files."""


def pack_files(src_dir: str | Path, names: Sequence[str], out: BinaryIO) -> int:
    """Write a deterministic tar of ``src_dir/<name>`` for each name (sorted) to ``out``; return
    the number of bytes written."""
    src_dir = Path(src_dir)
    start = out.tell()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in sorted(names):
            path = src_dir / name
            info = tarfile.TarInfo(name)
            info.size = path.stat().st_size
            info.mtime = 0
            info.mode = 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.type = tarfile.REGTYPE
            with open(path, "rb") as handle:
                tar.addfile(info, handle)
    out.flush()
    return out.tell() - start


def unpack_files(
    chunks: Iterable[bytes], dest_dir: str | Path, names: Sequence[str], max_member_bytes: int
) -> None:
    """Extract exactly ``names`` from the tar in ``chunks`` into the existing ``dest_dir``.
    Raises ``ArchiveError`` (and leaves whatever was written for the caller to discard)."""
    dest_dir = Path(dest_dir)
    expected = set(names)
    seen: set[str] = set()
    reader = io.BufferedReader(_ChunkReader(iter(chunks)), buffer_size=1 << 20)
    try:
        with tarfile.open(fileobj=reader, mode="r|") as tar:
            for member in tar:
                if member.name not in expected:
                    raise ArchiveError(f"unexpected archive member {member.name!r}")
                if not member.isreg():
                    raise ArchiveError(f"archive member {member.name!r} is not a regular file")
                if member.name in seen:
                    raise ArchiveError(f"archive member {member.name!r} appears twice")
                if member.size > max_member_bytes:
                    raise ArchiveError(
                        f"archive member {member.name!r} has {member.size} bytes, above {max_member_bytes}"
                    )
                seen.add(member.name)
                source = tar.extractfile(member)
                with open(dest_dir / member.name, "xb") as out:
                    shutil.copyfileobj(source, out, 1 << 20)
    except tarfile.TarError as exc:
        raise ArchiveError(f"not a valid archive: {exc}") from exc
    missing = expected - seen
    if missing:
        raise ArchiveError(f"archive lacks {', '.join(sorted(missing))}")


class _ChunkReader(io.RawIOBase):
    """A read-only file over an iterator of byte chunks."""

    def __init__(self, chunks: Iterator[bytes]):
        self._chunks = chunks
        self._pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            try:
                self._pending = next(self._chunks)
            except StopIteration:
                return 0
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n
