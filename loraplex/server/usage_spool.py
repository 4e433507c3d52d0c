"""Usage batches that could not be written to the registry, kept on disk until they can.

When the recorder must let go of usage it could not write (the database unreachable at
shutdown, or its in-memory bound reached during a long outage), each batch goes to one file
under the spool directory (``<home>/usage-spool/<batch id>.json``), with its batch id. A later
recorder on the same home (the restarted server, or a process sharing the home) replays the
files through the same idempotent write, with the same ids, and deletes a file only once its
batch is committed: a crash between the commit and the delete replays a batch the database has
recorded already, which its id makes a no-op.

A file is written atomically (a temporary file in the same directory, fsync, rename, fsync of
the directory): a reader sees a whole batch or none. A file that cannot be read as a batch is
renamed aside (``*.bad``, kept for a person to look at) and the others replay. Several
processes may replay one directory at once: a file another process deleted or set aside first
is skipped (``FileNotFoundError`` from ``load``, ``remove`` and ``set_aside`` is theirs to
ignore; ``remove`` and ``set_aside`` already do).
"""

from __future__ import annotations

import json
import os
import re
import uuid
from datetime import datetime, timezone
from hashlib import sha256
from pathlib import Path

from loraplex.registry.usage import BATCH_ID_MAX_LENGTH, COUNTERS
from loraplex.storage.durable import fsync_directory

# (tenant, adapter, hour) -> the COUNTERS, in order: ``usage_outbox.Batch.rows``
Rows = dict[tuple, tuple[int, ...]]

FORMAT = "loraplex.usage-batch"
FORMAT_VERSION = 1
SUFFIX = ".json"
SET_ASIDE_SUFFIX = ".bad"
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class SpoolFileError(ValueError):
    """A spool file that is not a usage batch this version can read."""


class UsageSpool:
    """One directory of spooled usage batches, one file per batch."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)

    def save(self, batch) -> Path:
        """Write ``batch`` (a ``usage_outbox.Batch``: ``id`` and ``rows``) to its file,
        atomically and durably; returns the path. Raises OSError."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / _file_name(batch.id)
        temp = self.directory / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        data = json.dumps(_to_json(batch), separators=(",", ":")).encode()
        try:
            with open(temp, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        fsync_directory(self.directory)  # the rename itself survives a power loss
        return path

    def files(self) -> list[Path]:
        """The spooled batches' files, by name (temporary and set-aside files left out)."""
        try:
            names = sorted(e.name for e in os.scandir(self.directory)
                           if e.name.endswith(SUFFIX) and not e.name.startswith(".") and e.is_file())
        except FileNotFoundError:
            return []
        return [self.directory / name for name in names]

    def count(self) -> int:
        return len(self.files())

    def load(self, path: Path) -> tuple[str, Rows]:
        """The batch id and rows in ``path``. Raises SpoolFileError for a file that is not one,
        FileNotFoundError for one already gone (another process replayed it)."""
        try:
            text = path.read_bytes().decode()
        except UnicodeDecodeError as exc:
            raise SpoolFileError(f"not UTF-8 text: {exc}") from None
        try:
            return _from_json(json.loads(text))
        except SpoolFileError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise SpoolFileError(f"not a usage batch: {type(exc).__name__}: {exc}") from None

    def remove(self, path: Path) -> None:
        """Delete a replayed batch's file (gone already: another process replayed it too)."""
        path.unlink(missing_ok=True)
        fsync_directory(self.directory)

    def set_aside(self, path: Path) -> Path | None:
        """Rename an unreadable file to a ``.bad`` name no other file has; None when it was gone."""
        for n in range(1000):
            target = path.with_name(path.name + (SET_ASIDE_SUFFIX if n == 0 else f".{n}{SET_ASIDE_SUFFIX}"))
            if target.exists():
                continue
            try:
                os.rename(path, target)
            except FileNotFoundError:
                return None  # another process set it aside (or replayed it) first
            return target
        raise OSError(f"no free name to set {path} aside")


def _file_name(batch_id: str) -> str:
    # the recorder's ids are hex; any other id gets a name that cannot leave the directory
    if _SAFE_NAME.fullmatch(batch_id) and not batch_id.startswith("."):
        return batch_id + SUFFIX
    return "id-" + sha256(batch_id.encode()).hexdigest()[:40] + SUFFIX


def _to_json(batch) -> dict:
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "batch_id": batch.id,
        "spooled_at": datetime.now(timezone.utc).isoformat(),
        "rows": [{"tenant": tenant, "adapter": adapter, "hour": hour.isoformat(),
                  "counts": dict(zip(COUNTERS, counts))}
                 for (tenant, adapter, hour), counts in batch.rows.items()],
    }


def _from_json(doc) -> tuple[str, Rows]:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SpoolFileError(f"no `format: {FORMAT}`")
    if doc.get("version") != FORMAT_VERSION:
        raise SpoolFileError(f"format version {doc.get('version')!r}, this version reads {FORMAT_VERSION}")
    batch_id = doc["batch_id"]
    if not isinstance(batch_id, str) or not 0 < len(batch_id) <= BATCH_ID_MAX_LENGTH:
        raise SpoolFileError(f"batch id {batch_id!r} is not 1 to {BATCH_ID_MAX_LENGTH} characters")
    rows: Rows = {}
    for row in doc["rows"]:
        hour = datetime.fromisoformat(row["hour"])
        if hour.tzinfo is None:
            raise SpoolFileError(f"hour without a time zone: {row['hour']!r}")
        counts = tuple(row["counts"][name] for name in COUNTERS)
        if any(isinstance(c, bool) or not isinstance(c, int) for c in counts):
            raise SpoolFileError(f"counts must be integers: {row['counts']!r}")
        # tenant and adapter are taken as they are: a value the database refuses is dropped
        # (and logged) by the recorder row by row, as it would have been before spooling
        key = (row["tenant"], row["adapter"], hour.astimezone(timezone.utc))
        if key in rows:
            raise SpoolFileError(f"row {key!r} twice")
        rows[key] = counts
    return batch_id, rows
