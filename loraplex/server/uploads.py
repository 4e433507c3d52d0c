"""Adapter uploads: multipart fields or one archive, written into a private staging directory.

An archive (``.tar.gz`` / ``.tgz`` / ``.tar`` / ``.zip``) is unpacked member by member by this
code, never with ``extractall``: absolute paths, ``..`` components, links (symbolic or hard),
devices and other special members, and members larger than the cap are rejected, so no path can
leave the staging directory. The PEFT directory is the staging root or its single sub-directory
holding ``adapter_config.json``. The metadata macOS adds (``__MACOSX/``, ``._*``) is skipped.

Decompression bombs: besides the cap per member (``max_upload_member_bytes``), an archive unpacks
to at most ``MAX_ARCHIVE_MEMBERS`` members and at most twice the member cap in all (room for the
weights and whatever else a PEFT directory holds); the bytes are counted as they are written, not
taken from the archive's own headers.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import lzma
import shutil
import stat
import tarfile
import tempfile
import time
import zipfile
import zlib
from pathlib import Path, PurePosixPath

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from loraplex.lora.snapshot import SNAPSHOT_PREFIX
from loraplex.server.errors import APIError, bad_request

CONFIG_FIELD = "adapter_config.json"
WEIGHTS_FIELD = "adapter_model.safetensors"
ARCHIVE_FIELD = "archive"
_COPY_CHUNK = 1 << 20
STAGING_PREFIX = "upload-"
STALE_STAGING_SECONDS = 3600
log = logging.getLogger("loraplex.server")
MAX_ARCHIVE_MEMBERS = 1000
# what the file system answers to member paths an archive itself makes impossible: a file and a
# folder of one path (in either order), or a name longer than the file system takes. The archive
# is bad (400), not the server; other OSErrors (ENOSPC, EIO) stay server errors
_CLASH = "clashes with another member (one path is both a file and a folder)"
_MEMBER_PATH_ERRNOS = {errno.EEXIST: _CLASH, errno.ENOTDIR: _CLASH, errno.EISDIR: _CLASH,
                       errno.ENAMETOOLONG: "has a name too long for the file system"}


def new_staging_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=root))


def sweep_stale_staging(root: Path, max_age_seconds: float = STALE_STAGING_SECONDS) -> list[Path]:
    """Remove upload staging directories and adapter copies (``adapter_snapshot``) a crash left
    under ``root``: those whose newest file is older than ``max_age_seconds`` (a younger one may
    be an upload of another process sharing the home). Returns the directories removed."""
    if not root.is_dir():
        return []
    cutoff = time.time() - max_age_seconds
    removed = []
    for d in root.iterdir():
        if not d.name.startswith((STAGING_PREFIX, SNAPSHOT_PREFIX)) or not d.is_dir() or d.is_symlink():
            continue
        try:
            newest = max([d.lstat().st_mtime] + [p.lstat().st_mtime for p in d.rglob("*")])
        except OSError:
            continue  # being removed by its owner right now
        if newest < cutoff:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
            log.info("removed stale upload staging directory %s", d)
    return removed


def too_large(what: str, limit: int, param: str = ARCHIVE_FIELD) -> APIError:
    return APIError(413, f"{what} is larger than the limit of {limit} bytes.", param=param, code="payload_too_large")


class _ArchiveBudget:
    """What an archive may still unpack: members and bytes in all (see the module docstring)."""

    def __init__(self, member_limit: int):
        self.total_limit = 2 * member_limit
        self.members = 0
        self.written = 0

    def add_member(self, name: str) -> None:
        self.members += 1
        if self.members > MAX_ARCHIVE_MEMBERS:
            raise bad_request(
                f"archive has more than {MAX_ARCHIVE_MEMBERS} members (at {name!r})", param=ARCHIVE_FIELD
            )

    def spend(self, nbytes: int) -> None:
        """Count bytes about to be written; a 413 once the archive's total would pass its cap."""
        self.written += nbytes
        if self.written > self.total_limit:
            raise too_large("the archive's unpacked contents", self.total_limit)


def _copy_capped(
    src, dst_path: Path, limit: int, what: str, budget: _ArchiveBudget | None = None, param: str = ARCHIVE_FIELD
) -> int:
    """Copy a binary stream to a new file, refusing more than ``limit`` bytes (and, with
    ``budget``, more than the archive has left); a 413 names ``param``."""
    total = 0
    with open(dst_path, "xb") as dst:
        while True:
            chunk = src.read(_COPY_CHUNK)
            if not chunk:
                return total
            total += len(chunk)
            if total > limit:
                raise too_large(what, limit, param)
            if budget is not None:
                budget.spend(len(chunk))
            dst.write(chunk)


@contextlib.contextmanager
def _member_path_errors(name: str):
    """Around one member's unpacking: a 400 naming it for the path errors its name causes."""
    try:
        yield
    except OSError as exc:
        why = _MEMBER_PATH_ERRNOS.get(exc.errno)
        if why is None:
            raise
        raise bad_request(f"archive member {name!r} {why}", param=ARCHIVE_FIELD) from None


def is_finder_metadata(name: str) -> bool:
    """A member macOS adds to the archives it makes (Finder's "Compress" puts resource forks
    under ``__MACOSX/``, its tar ``._name`` AppleDouble files beside each file): skipped, else
    ``__MACOSX`` counted as a second top folder and the adapter was not found."""
    parts = PurePosixPath(name).parts
    return bool(parts) and (parts[0] == "__MACOSX" or parts[-1].startswith("._"))


def _safe_member_path(staging: Path, name: str) -> Path:
    """Where an archive member goes, or a 400 if its name could leave the staging directory."""
    if not name or "\x00" in name or "\\" in name:
        raise bad_request(f"archive member {name!r} has an invalid name", param=ARCHIVE_FIELD)
    pure = PurePosixPath(name)
    if pure.is_absolute() or name.startswith("/"):
        raise bad_request(f"archive member {name!r} has an absolute path", param=ARCHIVE_FIELD)
    if any(part == ".." for part in pure.parts):
        raise bad_request(f"archive member {name!r} leaves the archive root (`..`)", param=ARCHIVE_FIELD)
    if len(pure.parts) > 8:
        raise bad_request(f"archive member {name!r} is nested too deep", param=ARCHIVE_FIELD)
    target = (staging / Path(*[p for p in pure.parts if p not in ("", ".")])).resolve()
    root = staging.resolve()
    if target != root and root not in target.parents:
        raise bad_request(f"archive member {name!r} leaves the archive root", param=ARCHIVE_FIELD)
    return target


def _unpack_tar(fileobj, staging: Path, member_limit: int) -> None:
    try:
        archive = tarfile.open(fileobj=fileobj, mode="r:*")
    except (tarfile.TarError, EOFError, OSError):
        raise bad_request(
            "archive is neither a zip file nor a readable tar file (.tar, .tar.gz, .tar.bz2, .tar.xz)",
            param=ARCHIVE_FIELD,
        ) from None
    budget = _ArchiveBudget(member_limit)
    with archive:
        for member in archive:
            budget.add_member(member.name)
            if is_finder_metadata(member.name):
                continue
            with _member_path_errors(member.name):
                _unpack_tar_member(archive, member, staging, member_limit, budget)


def _unpack_tar_member(archive: tarfile.TarFile, member: tarfile.TarInfo, staging: Path, member_limit: int,
                       budget: _ArchiveBudget) -> None:
    target = _safe_member_path(staging, member.name)
    if member.isdir():
        target.mkdir(parents=True, exist_ok=True)
        return
    if member.issym() or member.islnk():
        raise bad_request(f"archive member {member.name!r} is a link", param=ARCHIVE_FIELD)
    if not member.isreg():
        raise bad_request(f"archive member {member.name!r} is not a regular file", param=ARCHIVE_FIELD)
    if member.size > member_limit:
        raise too_large(f"archive member {member.name!r}", member_limit)
    if budget.written + member.size > budget.total_limit:  # refuse before decompressing it
        raise too_large("the archive's unpacked contents", budget.total_limit)
    target.parent.mkdir(parents=True, exist_ok=True)
    src = archive.extractfile(member)
    if src is None:
        raise bad_request(f"archive member {member.name!r} cannot be read", param=ARCHIVE_FIELD)
    try:
        _copy_capped(src, target, member_limit, f"archive member {member.name!r}", budget)
    except FileExistsError:
        raise bad_request(f"archive member {member.name!r} appears twice", param=ARCHIVE_FIELD) from None


def _unpack_zip(fileobj, staging: Path, member_limit: int) -> None:
    try:
        archive = zipfile.ZipFile(fileobj)
    except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError) as exc:
        raise bad_request(f"archive is not a readable zip file: {exc}", param=ARCHIVE_FIELD) from None
    budget = _ArchiveBudget(member_limit)
    with archive:
        for info in archive.infolist():
            budget.add_member(info.filename)
            if is_finder_metadata(info.filename):
                continue
            with _member_path_errors(info.filename):
                _unpack_zip_member(archive, info, staging, member_limit, budget)


def _unpack_zip_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, staging: Path, member_limit: int,
                       budget: _ArchiveBudget) -> None:
    target = _safe_member_path(staging, info.filename)
    mode = info.external_attr >> 16
    if stat.S_ISLNK(mode):
        raise bad_request(f"archive member {info.filename!r} is a link", param=ARCHIVE_FIELD)
    if info.is_dir():
        target.mkdir(parents=True, exist_ok=True)
        return
    if stat.S_IFMT(mode) not in (0, stat.S_IFREG):  # 0: made without unix modes
        raise bad_request(f"archive member {info.filename!r} is not a regular file", param=ARCHIVE_FIELD)
    if info.file_size > member_limit:
        raise too_large(f"archive member {info.filename!r}", member_limit)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with archive.open(info) as src:  # the cap is enforced on the bytes, not the declared size
            _copy_capped(src, target, member_limit, f"archive member {info.filename!r}", budget)
    except FileExistsError:
        raise bad_request(f"archive member {info.filename!r} appears twice", param=ARCHIVE_FIELD) from None
    except (zipfile.BadZipFile, NotImplementedError, RuntimeError) as exc:  # RuntimeError: encrypted
        raise bad_request(f"archive member {info.filename!r}: {exc}", param=ARCHIVE_FIELD) from None


def unpack_archive(fileobj, filename: str, staging: Path, member_limit: int) -> Path:
    """Unpack into ``staging``; returns the PEFT directory inside it. Zip or tar (plain, gzip,
    bzip2, xz) is told by the bytes, not by ``filename`` (a ``.zip`` that is a tar unpacks)."""
    head = fileobj.read(4)
    fileobj.seek(0)
    try:
        if head.startswith(b"PK"):
            _unpack_zip(fileobj, staging, member_limit)
        else:
            _unpack_tar(fileobj, staging, member_limit)
    except APIError:
        raise
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, lzma.LZMAError, ValueError, OSError) as exc:
        # ValueError: zipfile seeking to an offset a corrupt central directory made negative
        if isinstance(exc, OSError) and exc.errno is not None:
            raise  # the disk (ENOSPC, EIO, ...), not the archive: a server error
        # gzip/bz2 decompression errors are OSErrors without an errno
        raise bad_request(f"archive is truncated or corrupt ({str(exc)[:200]})", param=ARCHIVE_FIELD) from None
    return find_peft_dir(staging)


def find_peft_dir(staging: Path) -> Path:
    if (staging / CONFIG_FIELD).is_file():
        return staging
    subdirs = [p for p in staging.iterdir() if p.is_dir()]
    if len(subdirs) == 1 and (subdirs[0] / CONFIG_FIELD).is_file():
        return subdirs[0]
    raise bad_request(f"archive holds no `{CONFIG_FIELD}` at its root or in one top folder", param=ARCHIVE_FIELD)


def _field_to_file(value, target: Path, limit: int, field: str) -> None:
    if isinstance(value, UploadFile):
        value.file.seek(0)
        _copy_capped(value.file, target, limit, f"field `{field}`", param=field)
    elif isinstance(value, str):
        data = value.encode("utf-8")
        if len(data) > limit:
            raise too_large(f"field `{field}`", limit, field)
        target.write_bytes(data)
    else:
        raise bad_request(f"field `{field}` is missing", param=field)


async def stage_upload(form, staging: Path, member_limit: int) -> Path:
    """Write the upload in ``form`` (a parsed multipart form) into ``staging``; returns the PEFT dir.
    The copying and unpacking (seconds for a large archive) run in a worker thread, so the event
    loop keeps serving every other request and stream meanwhile."""
    return await run_in_threadpool(_stage_upload, form, staging, member_limit)


def _stage_upload(form, staging: Path, member_limit: int) -> Path:
    archive = form.get(ARCHIVE_FIELD)
    if archive is not None:
        if not isinstance(archive, UploadFile):
            raise bad_request("field `archive` must be a file", param=ARCHIVE_FIELD)
        archive.file.seek(0)
        return unpack_archive(archive.file, archive.filename or "", staging, member_limit)
    if form.get(CONFIG_FIELD) is None or form.get(WEIGHTS_FIELD) is None:
        missing = CONFIG_FIELD if form.get(CONFIG_FIELD) is None else WEIGHTS_FIELD
        raise bad_request(
            f"upload needs fields `{CONFIG_FIELD}` and `{WEIGHTS_FIELD}`, or one field `{ARCHIVE_FIELD}`",
            param=missing,
        )
    _field_to_file(form.get(CONFIG_FIELD), staging / CONFIG_FIELD, member_limit, CONFIG_FIELD)
    _field_to_file(form.get(WEIGHTS_FIELD), staging / WEIGHTS_FIELD, member_limit, WEIGHTS_FIELD)
    return staging


def remove_staging(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)

