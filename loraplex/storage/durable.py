"""Making a rename in a local directory durable (the blob store's puts, the usage spool's files)."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_directory(directory: Path) -> None:
    """Flush ``directory``'s entries, so a rename into it survives a power loss. Where it cannot
    be opened or fsynced (not every file system fsyncs a directory) this does nothing."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
