"""Helpers for registry tests: fake version metadata with real content hashes."""

from __future__ import annotations

import hashlib

from sqlalchemy import event
from sqlalchemy.exc import OperationalError


def version_fields(content: bytes, **overrides) -> dict:
    """Keyword arguments for RegistryService.add_version describing ``content``."""
    sha = hashlib.sha256(content).hexdigest()
    fields = {
        "sha256": sha,
        "base_model": "tiny-llama",
        "rank": 8,
        "alpha": 16.0,
        "targets": ["q_proj", "v_proj"],
        "size_bytes": len(content),
        "blob_key": f"sha256/{sha}",
        "uploader": "tester",
    }
    fields.update(overrides)
    return fields


class AckLost:
    """A session factory whose sessions raise a connection error right after a commit went
    through, while ``commits_to_fail`` is above zero (each failure uses one)."""

    def __init__(self, factory, commits_to_fail: int = 0):
        self.factory = factory
        self.commits_to_fail = commits_to_fail
        self.failed = 0

    def __call__(self):
        session = self.factory()
        event.listen(session, "after_commit", self._after_commit)
        return session

    def _after_commit(self, _session) -> None:
        if self.commits_to_fail > 0:
            self.commits_to_fail -= 1
            self.failed += 1
            raise OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"))
