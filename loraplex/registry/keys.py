"""API key secrets: generation, hashing and constant-time comparison.

A secret loraplex makes looks like ``lpx_<43 url-safe characters>`` (256 random bits). Only its
sha256 (hex) is stored; the first ``PREFIX_LENGTH`` characters are kept for display so admins can
tell keys apart. Keys an operator chose (vLLM's ``--api-key``) can look like anything within
``MAX_SECRET_LENGTH``; they are stored the same way, with a fixed display prefix instead of their
first characters (a short chosen key would be shown whole).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

SECRET_PREFIX = "lpx_"
ADMIN_SECRET_PREFIX = "lpx_admin_"
PREFIX_LENGTH = 12
MAX_SECRET_LENGTH = 256  # anything longer is not one of ours; refuse before hashing


def generate_secret(prefix: str = SECRET_PREFIX) -> str:
    return prefix + secrets.token_urlsafe(32)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def display_prefix(secret: str) -> str:
    return secret[:PREFIX_LENGTH]


def plausible_secret(secret: object) -> bool:
    """Worth a database lookup: a non-empty string no longer than any stored key can be."""
    return isinstance(secret, str) and 0 < len(secret) <= MAX_SECRET_LENGTH


def secret_matches(secret: str, stored_sha256: str | None) -> bool:
    """Constant-time check of ``secret`` against a stored hash."""
    if stored_sha256 is None:
        return False
    return hmac.compare_digest(hash_secret(secret).encode(), stored_sha256.encode())
