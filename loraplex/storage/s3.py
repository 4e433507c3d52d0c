"""A blob store in an S3 bucket (or any S3-compatible store) through boto3.

The endpoint, region and credentials come from the standard AWS settings, which boto3 reads
itself (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_DEFAULT_REGION``, profiles...);
``endpoint_url`` may also be passed explicitly. Retries are bounded at two levels: botocore
retries each request (``max_attempts``, standard mode with backoff, connect/read timeouts), and a
download that breaks mid-body resumes with a ranged GET from the last byte received, at most
``read_retries`` times per get in total (progress does not reset the count, so a link that
keeps breaking gives up in bounded time) with exponential backoff. Uploads above ``multipart_threshold`` go up in
parts of ``multipart_chunksize``.
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Iterator
from typing import BinaryIO

import boto3
import botocore.exceptions as bce
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from urllib3.exceptions import HTTPError as Urllib3HTTPError

from loraplex.storage.base import (
    DEFAULT_CHUNK_BYTES,
    BlobEntry,
    BlobIntegrityError,
    BlobNotFound,
    BlobStore,
    BlobStoreError,
    BlobStoreUnavailable,
    check_key,
)

log = logging.getLogger(__name__)
MiB = 1 << 20

# What a broken body read looks like, depending on where urllib3/botocore notice it.
_STREAM_ERRORS = (
    bce.IncompleteReadError,
    bce.ResponseStreamingError,
    bce.ReadTimeoutError,
    bce.ConnectionClosedError,
    Urllib3HTTPError,
    ConnectionError,
    TimeoutError,
)
_UNREACHABLE_ERRORS = (
    bce.EndpointConnectionError,
    bce.ConnectTimeoutError,
    bce.ReadTimeoutError,
    bce.ConnectionClosedError,
    bce.ProxyConnectionError,
)
_NOT_FOUND_CODES = {"404", "NoSuchKey", "NotFound"}


class S3BlobStore(BlobStore):
    """Blobs as objects ``<prefix>/<key>`` in ``bucket``."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region_name: str | None = None,
        max_attempts: int = 4,
        connect_timeout: float = 5.0,
        read_timeout: float = 30.0,
        read_retries: int = 3,
        retry_backoff: float = 0.25,
        multipart_threshold: int = 64 * MiB,
        multipart_chunksize: int = 16 * MiB,
        client=None,
    ):
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.read_retries = read_retries
        self.retry_backoff = retry_backoff
        self._client = client or boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region_name,
            config=Config(
                retries={"total_max_attempts": max_attempts, "mode": "standard"},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                s3={"addressing_style": "path"},
            ),
        )
        self._transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=4,
        )

    # -- helpers -------------------------------------------------------------------------------

    def _object_key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def describe(self) -> str:
        where = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        return f"{where} at {self._client.meta.endpoint_url}"

    def _translate(self, exc: Exception, doing: str, key: str) -> BlobStoreError:
        """One clear error for everything boto3 may raise."""
        where = self.describe()
        if isinstance(exc, BlobStoreError):
            return exc
        if isinstance(exc, S3UploadFailedError) and isinstance(exc.__context__, Exception):
            inner = exc.__context__
            if isinstance(inner, (bce.ClientError, *_UNREACHABLE_ERRORS)):
                return self._translate(inner, doing, key)
        if isinstance(exc, bce.ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0
            if code in _NOT_FOUND_CODES:
                return BlobNotFound(f"blob {key} not found in {where}")
            if code == "NoSuchBucket":
                return BlobStoreError(f"{doing} blob {key}: bucket {self.bucket!r} does not exist ({where})")
            if status >= 500 or code in {"SlowDown", "ServiceUnavailable", "InternalError"}:
                return BlobStoreUnavailable(
                    f"{doing} blob {key}: S3 kept failing with {status} {code} after retries ({where})"
                )
            return BlobStoreError(f"{doing} blob {key} failed: {status} {code} ({where})")
        if isinstance(exc, _UNREACHABLE_ERRORS):
            return BlobStoreUnavailable(f"{doing} blob {key}: cannot reach S3 at {where}: {exc}")
        if isinstance(exc, bce.NoCredentialsError):
            return BlobStoreUnavailable(f"{doing} blob {key}: no AWS credentials configured for {where}")
        return BlobStoreError(f"{doing} blob {key} failed ({where}): {type(exc).__name__}: {exc}")

    # -- interface -----------------------------------------------------------------------------

    def put(self, key: str, stream: BinaryIO, size: int) -> None:
        object_key = self._object_key(key)
        reader = _ExactSizeReader(stream, size, key)
        try:
            self._client.upload_fileobj(reader, self.bucket, object_key, Config=self._transfer)
        except Exception as exc:  # noqa: BLE001 - translated into one clear error
            if isinstance(exc.__context__, BlobIntegrityError):
                raise exc.__context__ from None
            raise self._translate(exc, "storing", key) from exc

    def _open(self, object_key: str, key: str, start: int, etag: str | None):
        kwargs = {"Bucket": self.bucket, "Key": object_key}
        if start:
            kwargs["Range"] = f"bytes={start}-"
        if etag:
            kwargs["IfMatch"] = etag
        try:
            response = self._client.get_object(**kwargs)
        except Exception as exc:  # noqa: BLE001
            raise self._translate(exc, "fetching", key) from exc
        return response

    def get(self, key: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
        object_key = self._object_key(key)
        response = self._open(object_key, key, 0, None)
        return self._read(object_key, key, response, chunk_bytes)

    def _read(self, object_key: str, key: str, response, chunk_bytes: int) -> Iterator[bytes]:
        total = int(response["ContentLength"])
        etag = response.get("ETag")
        body = response["Body"]
        received = 0
        failures = 0
        try:
            while received < total:
                try:
                    chunk = body.read(min(chunk_bytes, total - received))
                    if not chunk:
                        raise ConnectionError("connection closed before the end of the body")
                except _STREAM_ERRORS as exc:
                    body.close()
                    failures += 1
                    if failures > self.read_retries:
                        raise BlobStoreUnavailable(
                            f"fetching blob {key}: download broke after {received} of {total} "
                            f"bytes, {failures} times ({self.describe()}): {exc}"
                        ) from exc
                    log.warning("blob %s: download broke at byte %d (%s); resuming", key, received, exc)
                    time.sleep(self.retry_backoff * 2 ** (failures - 1))
                    body = self._open(object_key, key, received, etag)["Body"]
                    continue
                received += len(chunk)
                yield chunk
        finally:
            body.close()

    def exists(self, key: str) -> bool:
        object_key = self._object_key(key)
        try:
            self._client.head_object(Bucket=self.bucket, Key=object_key)
        except Exception as exc:  # noqa: BLE001
            error = self._translate(exc, "checking", key)
            if isinstance(error, BlobNotFound):
                return False
            raise error from exc
        return True

    def delete(self, key: str) -> None:
        object_key = self._object_key(key)
        try:
            self._client.delete_object(Bucket=self.bucket, Key=object_key)
        except Exception as exc:  # noqa: BLE001
            error = self._translate(exc, "deleting", key)
            if not isinstance(error, BlobNotFound):
                raise error from exc


    def list_blobs(self, prefix: str = "sha256/") -> Iterator[BlobEntry]:
        base = f"{self.prefix}/" if self.prefix else ""
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base + prefix)
            for page in pages:
                for item in page.get("Contents", []):
                    key = item["Key"][len(base) :]
                    yield BlobEntry(key, int(item["Size"]), item["LastModified"].timestamp())
        except Exception as exc:  # noqa: BLE001
            raise self._translate(exc, "listing", prefix + "*") from exc

    def sweep_partial_puts(self, min_age_seconds: float) -> int:
        """Abort multipart uploads of blobs begun more than ``min_age_seconds`` ago: a process
        killed mid-put leaves its parts stored (and billed) until aborted. Needs
        ``s3:ListBucketMultipartUploads`` and ``s3:AbortMultipartUpload``; without them (or on a
        store that lists none) nothing is swept, and a bucket lifecycle rule can do it instead."""
        base = f"{self.prefix}/sha256/" if self.prefix else "sha256/"
        cutoff = time.time() - min_age_seconds
        aborted = 0
        try:
            pages = self._client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=base)
            for page in pages:
                for upload in page.get("Uploads", []):
                    if upload["Initiated"].timestamp() < cutoff:
                        self._client.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"],
                                                            UploadId=upload["UploadId"])
                        aborted += 1
        except Exception as exc:  # noqa: BLE001 - a sweep that cannot run leaves the rest of the pass
            log.warning("could not sweep unfinished multipart uploads in %s: %s", self.describe(),
                        self._translate(exc, "sweeping", "sha256/*"))
        return aborted


class _ExactSizeReader(io.RawIOBase):
    """Reads ``stream`` and fails (aborting the upload before it completes) when it holds more
    or fewer than ``size`` bytes."""

    def __init__(self, stream: BinaryIO, size: int, key: str):
        self._stream = stream
        self._size = size
        self._key = key
        self._read = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def read(self, n: int = -1) -> bytes:
        want = self._size - self._read + 1 if n is None or n < 0 else n
        chunk = self._stream.read(want)
        self._read += len(chunk)
        if self._read > self._size:
            raise BlobIntegrityError(f"blob {self._key}: stream holds more than the declared {self._size} bytes")
        if not chunk and n != 0 and self._read < self._size:
            raise BlobIntegrityError(
                f"blob {self._key}: stream ended after {self._read} of the declared {self._size} bytes"
            )
        return chunk

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)
