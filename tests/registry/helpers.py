"""Helpers for registry tests: fake version metadata with real content hashes."""

from __future__ import annotations

import hashlib


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
