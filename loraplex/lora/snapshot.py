"""A private copy of a PEFT directory's two files, taken before anything reads them.

An upload checks the files, hashes them, and then packs them into the blob: three reads. A
directory that changes between them (an operator re-saving an adapter while ``loraplex serve
--lora-modules`` starts, a runtime load of a directory another process writes) would store
bytes other than the ones hashed: a version whose blob fails verification on every fetch, and a
blob key taken by the wrong bytes. Reading the files once, into a directory only this process
writes, makes the checked, hashed and stored bytes the same.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from loraplex.lora.errors import InvalidAdapterError
from loraplex.lora.peft_format import CONFIG_NAME, WEIGHTS_NAME, reject_pickles

SNAPSHOT_FILES = (CONFIG_NAME, WEIGHTS_NAME)
SNAPSHOT_PREFIX = "loraplex-adapter-"


class OutsideAllowedPaths(InvalidAdapterError):
    """A file of the adapter resolved outside the paths the caller allows (see ``inside``)."""

    def __init__(self):
        super().__init__("an adapter file lies outside the allowed paths", param="lora_path")


@contextmanager
def adapter_snapshot(
    path: str | Path, max_file_bytes: int | None = None, inside: Callable[[str], bool] | None = None,
    temp_root: Path | None = None,
) -> Iterator[Path]:
    """A temporary directory holding a copy of ``path``'s adapter files, removed afterwards.
    Raises ``InvalidAdapterError`` (the same refusals as ``load_adapter_files`` for a missing
    directory, a missing file or a pickle; a file that cannot be read is named, by its file name
    only; so is a file over ``max_file_bytes``, the largest member a stored blob may be fetched
    with, ``AdapterManager.max_member_bytes``).

    ``inside(real_path)`` confines the read: each file is opened, then the file that was opened
    must be the one its resolved path names now, and that path must be ``inside``; else
    ``OutsideAllowedPaths``. A link swapped in between a caller's path check and this read is
    caught so: what was read either lies where the check allowed or is refused.

    ``temp_root``: where the copy is made (default: the system's temporary folder). The server
    passes its staging folder, which it sweeps at start: a process killed mid-check left a copy
    of a tenant's weights in /tmp for good."""
    path = Path(path)
    if not path.is_dir():
        raise InvalidAdapterError(f"adapter path {str(path)!r} is not a directory")
    reject_pickles(path)
    if temp_root is not None:
        temp_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=SNAPSHOT_PREFIX, dir=temp_root) as temp:
        for name in SNAPSHOT_FILES:
            source = path / name
            if not source.exists():
                raise InvalidAdapterError(f"{name} is missing")
            copy = Path(temp) / name
            try:
                with open(source, "rb") as handle:
                    if inside is not None:
                        _check_confined(handle.fileno(), source, inside)
                    _check_size(name, os.fstat(handle.fileno()).st_size, max_file_bytes)  # before copying it
                    with open(copy, "xb") as out:
                        shutil.copyfileobj(handle, out, 1 << 20)
            except OSError as exc:  # unreadable, a directory, vanished meanwhile
                reason = exc.strerror or type(exc).__name__
                raise InvalidAdapterError(f"{name} cannot be read: {reason}") from None
            _check_size(name, copy.stat().st_size, max_file_bytes)  # it may have grown meanwhile
        yield Path(temp)


def _check_size(name: str, size: int, max_file_bytes: int | None) -> None:
    # a blob member above the fetch's cap would be stored, then refused on every fetch
    if max_file_bytes is not None and size > max_file_bytes:
        raise InvalidAdapterError(
            f"{name} has {size} bytes, above this server's limit of {max_file_bytes} bytes per adapter file "
            "(max_upload_member_bytes)"
        )


def _check_confined(fd: int, source: Path, inside: Callable[[str], bool]) -> None:
    real = os.path.realpath(source)
    opened, named = os.fstat(fd), os.stat(real)
    if (opened.st_dev, opened.st_ino) != (named.st_dev, named.st_ino) or not inside(real):
        raise OutsideAllowedPaths()
