"""The upload path of ``AdapterManager`` (loraplex/registry/adapter_manager.py).

Upload: validate (``inspect_adapter_dir``: format, and fit to the served base model) -> content
hash -> blob ``sha256/<hash>`` (a deterministic tar of the two PEFT files; skipped when the store
already has it) -> version row. The row is written last, so no version is ever visible without
its blob; when writing the row fails, a blob this upload created is removed again (unless a
version row uses it by then). A crash between the two leaves at most an unreferenced blob.

Blobs are shared by content, so a delete of the last other version using the same bytes may race
an upload. Both go through the blob's database lock (``RegistryService.delete_blob_if_unused`` /
``add_version(check_blob=...)``, see ``repository.lock_blob``): a deleter counts the live
versions using the blob and deletes it holding the lock; the uploader checks that the blob is
still in the store holding the same lock, before its row is written, and if it is gone stores it
again and retries. Across threads and processes, a committed version row always has its blob.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from loraplex.lora.peft_format import CONFIG_NAME, WEIGHTS_NAME, inspect_adapter_dir
from loraplex.lora.snapshot import adapter_snapshot
from loraplex.lora.spec import LoRATargetSpec
from loraplex.registry.errors import BlobMissing, InvalidName, NotFound
from loraplex.registry.info import VersionInfo
from loraplex.registry.names import validate_adapter_name, validate_tenant_name
from loraplex.registry.service import RegistryService
from loraplex.registry.version_batch import ActiveVersion, NewVersion
from loraplex.storage.archive import pack_files
from loraplex.storage.base import BlobStore, BlobStoreError, content_key

log = logging.getLogger(__name__)

ADAPTER_FILES = (CONFIG_NAME, WEIGHTS_NAME)  # what an adapter's blob holds
# An upload whose blob a concurrent delete removed stores it again; a blob deleted this many
# times in a row during one upload means something deletes blobs without the lock protocol.
UPLOAD_BLOB_ATTEMPTS = 5
T = TypeVar("T")


class AdapterUploadMixin:
    """Upload methods of ``AdapterManager``: adapter directories -> blobs and version rows."""

    registry: RegistryService
    blobs: BlobStore
    spec: LoRATargetSpec
    max_lora_rank: int
    max_member_bytes: int
    snapshot_root: Path | None
    base_model_names: frozenset[str]

    def check_adapter_name(self, name: str) -> None:
        """``InvalidName`` unless ``name`` is a valid adapter name that is not the base model's:
        a request naming it would reach the base model, and the adapter only as ``name@N``."""
        validate_adapter_name(name)
        if name in self.base_model_names:
            raise InvalidName(f"adapter name {name!r} is the served base model's name: requests naming it reach the "
                              "base model; choose another name")

    def _delete_blob_if_unused(self, content_hash: str, blob_key: str) -> None:
        raise NotImplementedError  # provided by AdapterManager

    def upload(
        self, tenant: str, name: str, adapter_dir: str | Path, uploader: str = "admin", origin: str | None = None,
        warnings: list[str] | None = None, activate: bool = False, create_only: bool = False,
    ) -> tuple[VersionInfo, bool]:
        """Store a PEFT directory as a new version of ``tenant/name``. Returns ``(version,
        created)``; ``created`` is False when identical weights already are a live version of
        this adapter (that version is returned). ``activate``: that version becomes the active
        one in the same registry transaction. Raises ``InvalidAdapterError``, ``NotFound``
        (tenant), ``InvalidName``, ``ManagedByOperator`` (a runtime ``origin`` writing to an
        operator's adapter, see ``adapter_origin``) or a blob store error; on any failure no
        version is added. ``warnings``, when given, receives what the validator noted about an
        accepted adapter (e.g. LoRA on a vision tower that is not served), for the upload's answer.
        ``create_only``: ``AlreadyExists`` when the name already lives (``add_version``'s)."""
        validate_tenant_name(tenant)
        self.check_adapter_name(name)
        if self.registry.get_tenant(tenant) is None:
            raise NotFound(f"tenant {tenant!r} not found")
        # one read of the files: the bytes checked and hashed are the bytes stored
        with adapter_snapshot(adapter_dir, self.max_member_bytes, temp_root=self.snapshot_root) as snapshot:
            return self._upload_checked(tenant, name, snapshot, uploader, origin, warnings, activate, create_only)

    def _upload_checked(self, tenant: str, name: str, adapter_dir: Path, uploader: str, origin: str | None,
                        warnings: list[str] | None, activate: bool = False,
                        create_only: bool = False) -> tuple[VersionInfo, bool]:
        info = inspect_adapter_dir(adapter_dir, self.spec, self.max_lora_rank)
        for warning in info.warnings:
            log.warning("adapter %s/%s: %s", tenant, name, warning)
        if warnings is not None:
            warnings.extend(info.warnings)
        key = content_key(info.content_hash)
        created_blob = False
        try:
            for _ in range(UPLOAD_BLOB_ATTEMPTS):
                if not self.blobs.exists(key):
                    self._put_blob(adapter_dir, key)
                    created_blob = True
                try:
                    return self.registry.add_version(
                        tenant,
                        name,
                        sha256=info.content_hash,
                        base_model=self.spec.model_name,
                        rank=info.rank,
                        alpha=info.alpha,
                        targets=list(info.targets),
                        size_bytes=info.size_bytes,
                        blob_key=key,
                        uploader=uploader,
                        # under the blob's lock: a delete that found no other user of these
                        # bytes may have removed the blob since our exists()/put
                        check_blob=lambda: self.blobs.exists(key),
                        origin=origin,
                        activate=activate,
                        create_only=create_only,
                    )
                except BlobMissing:
                    log.info("blob %s was deleted by a concurrent delete during an upload; storing it again", key)
            raise BlobStoreError(
                f"blob {key} in {self.blobs.describe()} was deleted {UPLOAD_BLOB_ATTEMPTS} times while "
                "uploading it; try again"
            )
        except BaseException:
            if created_blob:
                self._delete_blob_if_unused(info.content_hash, key)
            raise

    def upload_active(
        self, tenant: str, name: str, adapter_dir: str | Path, uploader: str = "admin", origin: str | None = None,
        create_only: bool = False,
    ) -> tuple[VersionInfo, bool, bool]:
        """``upload``, then make that version the one ``name`` serves (a hot-swap, as
        ``PUT .../active`` is, unless it already is). Returns ``(version, created, activated)``;
        identical weights already live add no version, and an unchanged active version writes
        no audit event (so a restart with the same directories changes nothing). The version is
        written and made active in one transaction: a write between the two (an operator upload
        taking over a runtime adapter) cannot leave a version a refused call added."""
        before = self.registry.get_adapter(tenant, name)  # NotFound without the tenant, as upload
        version, created = self.upload(tenant, name, adapter_dir, uploader=uploader, origin=origin, activate=True,
                                       create_only=create_only)
        return version, created, before is None or before.active_version != version.version

    def upload_all_active(self, tenant: str, dirs: Sequence[tuple[str, Path]], uploader: str) -> list[ActiveVersion]:
        """``upload_active`` for several ``(name, directory)`` at once, all or nothing: every
        directory is checked and every blob stored before one registry transaction adds and
        activates all the versions (``RegistryService.add_versions_active``). On failure no
        version is added and blobs this call stored are removed again (unless used)."""
        validate_tenant_name(tenant)
        return self.store_then_register(dirs, lambda versions, check_blob: self.registry.add_versions_active(
            tenant, versions, uploader=uploader, check_blob=check_blob))

    def store_then_register(self, dirs: Sequence[tuple[str, Path]],
                            register: Callable[[list[NewVersion], Callable[[str], bool]], T]) -> T:
        """Check every ``(name, directory)`` and store every blob, then call ``register(versions,
        check_blob)``: one registry transaction writing those versions, which calls
        ``check_blob(blob_key)`` holding the blobs' locks (``add_versions_active``'s). When it
        raises ``BlobMissing`` (a concurrent delete) the blobs are stored again and it is called
        again. On failure the blobs this call stored are removed again (unless used); a
        ``BlobStoreError`` names its adapter as ``adapter``. Returns what ``register`` returned."""
        for name, _ in dirs:
            self.check_adapter_name(name)
        infos = [(name, inspect_adapter_dir(path, self.spec, self.max_lora_rank), path) for name, path in dirs]
        versions = [NewVersion(name, info.content_hash, self.spec.model_name, info.rank, info.alpha,
                               list(info.targets), info.size_bytes, content_key(info.content_hash))
                    for name, info, _ in infos]
        created: dict[str, str] = {}  # blob key -> content hash, for the clean-up
        try:
            for _ in range(UPLOAD_BLOB_ATTEMPTS):
                for name, info, path in infos:
                    key = content_key(info.content_hash)
                    try:
                        if not self.blobs.exists(key):
                            self._put_blob(path, key)
                            created[key] = info.content_hash
                    except BlobStoreError as exc:
                        exc.adapter = name  # which one, for the caller's message
                        raise
                try:
                    return register(versions, self.blobs.exists)
                except BlobMissing:
                    log.info("a blob was deleted by a concurrent delete during a batch upload; storing it again")
            raise BlobStoreError(f"blobs in {self.blobs.describe()} kept being deleted while uploading them; try again")
        except BaseException:
            for key, content_hash in created.items():
                self._delete_blob_if_unused(content_hash, key)
            raise

    def _put_blob(self, adapter_dir: str | Path, key: str) -> None:
        with tempfile.TemporaryFile() as archive:
            size = pack_files(adapter_dir, ADAPTER_FILES, archive)
            archive.seek(0)
            self.blobs.put(key, archive, size)
