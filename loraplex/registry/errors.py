"""Registry errors. Each carries the HTTP status a server should answer with (``http_status``)."""

from __future__ import annotations


class RegistryError(Exception):
    """Base of every registry error; its message is safe to show to the caller."""

    http_status = 400


class InvalidName(RegistryError, ValueError):
    """A tenant name, adapter name or model reference broke a naming rule (the message says which)."""

    http_status = 400


class InvalidSetting(RegistryError, ValueError):
    """A tenant setting was out of range or unknown; ``param`` names the field."""

    http_status = 400

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class NotFound(RegistryError, LookupError):
    """The tenant, adapter, version or key does not exist (or was deleted)."""

    http_status = 404


class Conflict(RegistryError):
    """The request conflicts with the current state (e.g. deleting the active version)."""

    http_status = 409


class AlreadyExists(Conflict):
    """An object with that name already exists."""

    http_status = 409


class TenantDeleted(Conflict):
    """The name belonged to a tenant that was deleted: tenant names are never reused, so usage
    kept under the name (for billing) always means that one tenant."""

    http_status = 409


class BlobMissing(Conflict):
    """A version row was about to be committed but its blob was no longer in the store (deleted
    by a concurrent delete of the last other version using it): nothing was written. The
    uploader stores the blob again and retries (``AdapterManager.upload`` does)."""

    http_status = 409


class ManagedByOperator(RegistryError):
    """A runtime endpoint (vLLM's ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``) was
    asked to change an adapter the operator manages (admin API, CLI, ``serve --lora-modules``):
    refused, nothing changed."""

    http_status = 403
