"""The blob store interface, its errors, content-addressed keys and ``open_blob_store(url)``.

A blob store holds immutable byte strings under keys. loraplex stores one blob per adapter
version under ``sha256/<content_hash>`` (see ``content_key``). Stores know nothing about what
the bytes mean: the caller (the adapter manager) checks them against the registry after a get.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from collections.abc import Iterator
from typing import BinaryIO

DEFAULT_CHUNK_BYTES = 1 << 20

# Every path segment starts with a letter or digit, so ".." or "." can never be a segment and a
# key can never leave the store's root (directory) or prefix (S3).
_KEY_RE = re.compile(r"^[a-z0-9][a-z0-9_-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)+$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class BlobStoreError(Exception):
    """Any blob store failure; the message says which store and key."""


class BlobNotFound(BlobStoreError):
    """The key is not in the store."""


class BlobStoreUnavailable(BlobStoreError):
    """The store could not be reached or kept failing after bounded retries."""


class BlobIntegrityError(BlobStoreError):
    """The bytes read (or written) are not what was expected: wrong size or wrong hash."""


def content_key(sha256_hex: str) -> str:
    """The key of a content-addressed blob: ``sha256/<64 lower-case hex digits>``."""
    if not _SHA256_RE.match(sha256_hex or ""):
        raise ValueError(f"not a sha256 hex digest: {sha256_hex!r}")
    return f"sha256/{sha256_hex}"


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe store key, else raise ``ValueError``."""
    if not isinstance(key, str) or len(key) > 512 or not _KEY_RE.match(key):
        raise ValueError(f"invalid blob key {key!r}: expected segments like 'sha256/<hex>'")
    return key


@dataclass(frozen=True)
class BlobEntry:
    """A stored blob as listed: key, size in bytes, last modification (unix seconds)."""

    key: str
    size: int
    modified: float


class BlobStore(ABC):
    """Immutable blobs under keys. ``put`` streams from a file object of known size; ``get``
    streams chunks back. A key either holds a complete blob or nothing (never a partial one)."""

    @abstractmethod
    def put(self, key: str, stream: BinaryIO, size: int) -> None:
        """Store exactly ``size`` bytes read from ``stream`` under ``key`` (replacing any).
        Raises ``BlobIntegrityError`` if the stream holds more or fewer bytes."""

    @abstractmethod
    def get(self, key: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
        """Open ``key`` and return an iterator over its bytes. Raises ``BlobNotFound`` at once
        (not on first iteration) when the key is missing."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` holds a blob."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error."""

    @abstractmethod
    def list_blobs(self, prefix: str = "sha256/") -> Iterator[BlobEntry]:
        """Every blob whose key starts with ``prefix`` (for garbage collection)."""

    @abstractmethod
    def describe(self) -> str:
        """Where the blobs live, for logs and error messages (no secrets)."""

    def sweep_partial_puts(self, min_age_seconds: float) -> int:
        """Remove what puts that never finished (a process killed mid-upload) left, once older
        than ``min_age_seconds`` (a put running now is younger); returns how many. Nothing to
        do for a store whose puts leave nothing behind."""
        return 0


def check_blob_url(url: str) -> None:
    """Raise ValueError for a blob url of no form ``open_blob_store`` opens (nothing is opened:
    ``loraplex serve`` checks its ``--blob-url`` so before anything starts)."""
    if url.startswith("s3://"):
        if not url[len("s3://") :].partition("/")[0]:
            raise ValueError(f"blob url {url!r} names no bucket (expected s3://bucket/prefix)")
    elif "://" in url and not url.startswith("file://"):
        raise ValueError(f"unsupported blob url {url!r}: use a directory path, file:// or s3://")


def open_blob_store(url: str, **options) -> BlobStore:
    """Open the store a ``LORAPLEX_BLOB_URL`` names.

    * ``s3://bucket/prefix``: ``S3BlobStore`` (endpoint and credentials from the standard AWS
      settings, e.g. ``AWS_ENDPOINT_URL``; ``options`` go to ``S3BlobStore``);
    * ``file:///path`` or a plain path: ``LocalBlobStore`` (created if missing).
    """
    check_blob_url(url)
    if url.startswith("s3://"):
        from loraplex.storage.s3 import S3BlobStore

        bucket, _, prefix = url[len("s3://") :].partition("/")
        return S3BlobStore(bucket, prefix, **options)
    from loraplex.storage.local import LocalBlobStore

    path = url[len("file://") :] if url.startswith("file://") else url
    return LocalBlobStore(path, **options)
