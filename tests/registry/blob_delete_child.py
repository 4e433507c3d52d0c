"""Child process for the cross-process blob delete race test.

Usage: python -m tests.registry.blob_delete_child DB_URL BLOB_DIR BLOB_KEY
Runs ``RegistryService.delete_blob_if_unused`` for BLOB_KEY as another server process would. Once
it has found no live version using the blob (holding the blob's lock), it prints ``deleting`` and
waits for a line on stdin before deleting; then prints ``deleted <True|False>``.
"""

from __future__ import annotations

import sys

from loraplex.registry.service import RegistryService
from loraplex.storage.base import open_blob_store


def main() -> None:
    db_url, blob_dir, blob_key = sys.argv[1:4]
    service = RegistryService.from_url(db_url)
    blobs = open_blob_store(blob_dir)

    def delete() -> None:
        print("deleting", flush=True)
        sys.stdin.readline()
        blobs.delete(blob_key)

    print(f"deleted {service.delete_blob_if_unused(blob_key, delete)}", flush=True)


if __name__ == "__main__":
    main()
