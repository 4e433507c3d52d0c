"""AdapterManager: the upload path (``AdapterUploadMixin``, loraplex/registry/adapter_upload.py)
and the way from ``(tenant, model ref)`` to local adapter files.

Resolve: registry -> local disk cache -> blob store. A fetch unpacks into a staging directory
and the disk cache recomputes the content hash before the entry becomes visible; a mismatch is
logged, audited (``blob.integrity_error``) and raised, and the bytes are not used. Concurrent
resolves of the same missing adapter share one fetch (single flight).

In-use tracking: ``acquire``/``release`` count requests running on a content hash (and pin its
disk copy). Deleting a version removes its row at once (new requests cannot resolve it) but its
blob and disk copy only after the last release, and only if no other live version row (any
tenant) uses the same blob. ``collect_garbage`` removes what a crash left behind (the server runs
it periodically, see ``blob_gc_interval_seconds``).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

from loraplex.lora.peft_format import compute_content_hash
from loraplex.lora.spec import AdapterRef, LoRATargetSpec
from loraplex.registry.adapter_upload import ADAPTER_FILES, AdapterUploadMixin
from loraplex.registry.info import VersionInfo
from loraplex.registry.service import RegistryService
from loraplex.registry.tenant_delete import TenantDeletion
from loraplex.storage.archive import ArchiveError, unpack_files
from loraplex.storage.base import BlobIntegrityError, BlobNotFound, BlobStore, BlobStoreError
from loraplex.storage.disk_cache import CacheIntegrityError, CacheTooSmallError, DiskCache

log = logging.getLogger(__name__)

SYSTEM_ACTOR = "system"


class AdapterManager(AdapterUploadMixin):
    """Uploads, resolves and deletes adapter versions across registry, blob store and disk cache.
    Thread-safe; one per process."""

    def __init__(
        self,
        registry: RegistryService,
        blobs: BlobStore,
        disk_cache: DiskCache,
        spec: LoRATargetSpec,
        max_lora_rank: int,
        *,
        max_member_bytes: int = 2 << 30,
        background_deletes: bool = False,
        snapshot_root: Path | None = None,
    ):
        """``background_deletes``: a delete deferred to the last ``release`` runs in a thread of
        its own instead of inside ``release`` (the server releases on its event loop, and the
        delete takes a database lock and a blob store round trip). ``snapshot_root``: where an
        upload's private copy of the files lives while checked (``adapter_snapshot``; default:
        the system's temporary folder)."""
        self.registry = registry
        self.background_deletes = background_deletes
        self.blobs = blobs
        self.disk_cache = disk_cache
        self.spec = spec
        self.max_lora_rank = max_lora_rank
        self.max_member_bytes = max_member_bytes
        self.snapshot_root = snapshot_root
        # the names a request's ``model`` resolves to the base model by (the server's served
        # model name, set once it is known): an adapter may not take one (``check_adapter_name``)
        self.base_model_names: frozenset[str] = frozenset()
        self._lock = threading.Lock()
        self._inflight: dict[str, Future] = {}  # content hash -> the running fetch
        self._in_use: Counter[str] = Counter()  # content hash -> running requests
        self._pending_delete: dict[str, str] = {}  # content hash -> blob key, deleted on last release
        self.fetches = 0
        self.fetch_seconds = 0.0
        self.integrity_errors = 0

    @staticmethod
    def make_disk_cache(root: str | Path, max_bytes: int) -> DiskCache:
        """The disk cache this manager expects (adapter content hashes as identity)."""
        return DiskCache(root, max_bytes, verify=compute_content_hash)

    # -- resolve -------------------------------------------------------------------------------

    def resolve(self, tenant: str, model_ref: str, *, acquire: bool = False) -> AdapterRef:
        """``name`` (active version) or ``name@N`` -> an ``AdapterRef`` whose ``path`` is a local
        PEFT directory. With ``acquire`` the version is also marked in use (call ``release``
        with its ``content_hash`` when the request ends), atomically with the lookup, so its
        files cannot be evicted or deleted in between."""
        version = self.registry.resolve(tenant, model_ref)
        try:
            path = self.local_path(version, acquire=acquire)
        except BlobNotFound:
            # deleted since the lookup? Then say so (NotFound) rather than blame the store.
            self.registry.resolve(tenant, version.ref)
            raise
        return AdapterRef(name=version.ref, path=str(path), content_hash=version.sha256)

    @contextmanager
    def lease(self, tenant: str, model_ref: str) -> Iterator[AdapterRef]:
        """``resolve(..., acquire=True)`` and ``release`` around a block."""
        ref = self.resolve(tenant, model_ref, acquire=True)
        try:
            yield ref
        finally:
            self.release(ref.content_hash)

    def local_path(self, version: VersionInfo, *, acquire: bool = False) -> Path:
        """The local directory of ``version``'s files, fetched once if missing."""
        content_hash = version.sha256
        for _ in range(3):  # an entry evicted between fetch and pin is fetched again
            path = self._ensure_local(version)
            if not acquire:
                return path
            with self._lock:
                self._in_use[content_hash] += 1
                self.disk_cache.pin(content_hash)
                if self.disk_cache.contains(content_hash) and path.is_dir():
                    return path
            self.release(content_hash)
        raise BlobIntegrityError(f"adapter {version.ref}: local copy keeps disappearing")

    def _ensure_local(self, version: VersionInfo) -> Path:
        content_hash = version.sha256
        path = self.disk_cache.get(content_hash)
        if path is not None:
            return path
        with self._lock:
            future = self._inflight.get(content_hash)
            leader = future is None
            if leader:
                future = Future()
                self._inflight[content_hash] = future
        if not leader:
            return future.result()
        try:
            path = self.disk_cache.get(content_hash)  # another leader may have just finished
            if path is None:
                path = self._fetch(version)
            future.set_result(path)
            return path
        except BaseException as exc:
            future.set_exception(exc)
            raise
        finally:
            with self._lock:
                self._inflight.pop(content_hash, None)

    def _fetch(self, version: VersionInfo) -> Path:
        started = time.monotonic()
        staging = self.disk_cache.new_staging_dir()
        try:
            chunks = self.blobs.get(version.blob_key)
            try:
                unpack_files(chunks, staging, ADAPTER_FILES, self.max_member_bytes)
                path = self.disk_cache.insert(version.sha256, staging)
            except (ArchiveError, CacheIntegrityError) as exc:
                self._integrity_failure(version, str(exc))
                raise BlobIntegrityError(
                    f"adapter {version.tenant}/{version.ref}: blob {version.blob_key} in "
                    f"{self.blobs.describe()} failed verification ({exc}); not used"
                ) from exc
            except CacheTooSmallError as exc:
                raise BlobStoreError(f"adapter {version.tenant}/{version.ref}: {exc}") from exc
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        with self._lock:
            self.fetches += 1
            self.fetch_seconds += time.monotonic() - started
        return path

    def _integrity_failure(self, version: VersionInfo, reason: str) -> None:
        with self._lock:
            self.integrity_errors += 1
        log.error(
            "integrity error: blob %s of %s/%s does not match sha256 %s: %s",
            version.blob_key, version.tenant, version.ref, version.sha256, reason,
        )
        try:
            self.registry.record_event(
                SYSTEM_ACTOR, "blob.integrity_error", version.tenant, "adapter", version.ref,
                {"sha256": version.sha256, "blob_key": version.blob_key, "reason": reason[:500]},
            )
        except Exception:  # noqa: BLE001 - the error itself is what the caller must see
            log.exception("could not audit the integrity error of %s", version.blob_key)

    # -- in-use tracking and deletes -------------------------------------------------------------

    def acquire(self, content_hash: str) -> None:
        """Mark one request as using this adapter version (its files stay until ``release``)."""
        with self._lock:
            self._in_use[content_hash] += 1
            self.disk_cache.pin(content_hash)

    def release(self, content_hash: str) -> None:
        with self._lock:
            if self._in_use[content_hash] <= 0:
                self._in_use.pop(content_hash, None)
                return
            self._in_use[content_hash] -= 1
            last = self._in_use[content_hash] == 0
            if last:
                self._in_use.pop(content_hash, None)
            self.disk_cache.unpin(content_hash)
            blob_key = self._pending_delete.pop(content_hash, None) if last else None
        if blob_key is None:
            return
        if self.background_deletes:
            threading.Thread(
                target=self._delete_blob_if_unused, args=(content_hash, blob_key), name="blob-delete", daemon=True
            ).start()  # a process that exits first leaves an orphan for collect_garbage
        else:
            self._delete_blob_if_unused(content_hash, blob_key)

    def in_use(self, content_hash: str) -> int:
        with self._lock:
            return self._in_use.get(content_hash, 0)

    def delete_version(self, tenant: str, name: str, version: int, actor: str = "admin") -> list[VersionInfo]:
        """Delete one version; its files go once no request uses them."""
        removed = self.registry.delete_version(tenant, name, version, actor)
        self._drop_files(removed)
        return removed

    def delete_adapter(self, tenant: str, name: str, actor: str = "admin",
                       origin: str | None = None) -> list[VersionInfo]:
        """Delete an adapter and all its versions; files go once no request uses them. A
        runtime ``origin`` deletes only a runtime adapter (else ``ManagedByOperator``)."""
        removed = self.registry.delete_adapter(tenant, name, actor, origin=origin)
        self._drop_files(removed)
        return removed

    def delete_tenant(self, tenant: str, actor: str = "admin") -> TenantDeletion:
        """Delete a tenant (``RegistryService.delete_tenant``); its versions' files go as a
        version delete's do: once no request uses them, and only blobs no live version uses."""
        deletion = self.registry.delete_tenant(tenant, actor)
        self._drop_files(deletion.versions)
        return deletion

    def _drop_files(self, removed: list[VersionInfo]) -> None:
        for version in removed:
            with self._lock:
                if self._in_use.get(version.sha256, 0) > 0:
                    self._pending_delete[version.sha256] = version.blob_key
                    continue
            self._delete_blob_if_unused(version.sha256, version.blob_key)

    def _delete_blob_if_unused(self, content_hash: str, blob_key: str) -> None:
        try:
            if self._delete_blob_unless_used(content_hash, blob_key):
                log.info("deleted blob %s and its local copy", blob_key)
            # else another live version (maybe another tenant's) has the same weights
        except Exception:  # noqa: BLE001 - an orphan blob is harmless; never mask the caller's error
            log.exception("could not delete blob %s", blob_key)

    def _delete_blob_unless_used(self, content_hash: str, blob_key: str) -> bool:
        """Delete the blob and its local copy when no live version uses it, counting and deleting
        under the blob's database lock (so no upload can add a row using it in between)."""

        def delete() -> None:
            self.blobs.delete(blob_key)
            self.disk_cache.remove(content_hash)

        return self.registry.delete_blob_if_unused(blob_key, delete)

    def collect_garbage(self, min_age_seconds: float = 3600.0, stop: threading.Event | None = None) -> list[str]:
        """Delete blobs that no live version uses: left by a crash between blob put and row
        insert, or by deletes deferred in a process that stopped before its requests finished.
        Blobs younger than ``min_age_seconds`` stay (an upload stores its blob before its row),
        as do blobs this process is using. Each count and delete runs under the blob's lock, as
        a version delete does, so an upload of the same bytes meanwhile keeps its blob. Stops
        early once ``stop`` is set. Returns the deleted keys. The store's unfinished puts of
        that age go too (a crash mid-put leaves a temporary file no key names)."""
        now = time.time()
        partial = self.blobs.sweep_partial_puts(min_age_seconds)
        if partial:
            log.info("removed %d unfinished blob put(s) older than %.0f s", partial, min_age_seconds)
        deleted = []
        for entry in list(self.blobs.list_blobs("sha256/")):
            if stop is not None and stop.is_set():
                break
            if now - entry.modified < min_age_seconds:
                continue
            content_hash = entry.key.split("/", 1)[1]
            with self._lock:
                if self._in_use.get(content_hash, 0) > 0 or content_hash in self._inflight:
                    continue
            if not self._delete_blob_unless_used(content_hash, entry.key):
                continue
            deleted.append(entry.key)
            log.info("garbage-collected unreferenced blob %s", entry.key)
        return deleted

    # -- reporting -------------------------------------------------------------------------------

    def tier_of(self, content_hash: str) -> str:
        """``"disk"`` when a local copy exists, else ``"store"`` (engine tiers are the engine's)."""
        return "disk" if self.disk_cache.contains(content_hash) else "store"

    def stats(self) -> dict:
        with self._lock:
            stats = {
                "fetches": self.fetches,
                "fetch_seconds": round(self.fetch_seconds, 6),
                "integrity_errors": self.integrity_errors,
                "in_use": dict(self._in_use),
                "pending_deletes": len(self._pending_delete),
            }
        stats["disk"] = self.disk_cache.stats()
        stats["blob_store"] = self.blobs.describe()
        return stats


def build_adapter_manager(
    settings, registry: RegistryService, spec: LoRATargetSpec, *, background_deletes: bool = False
) -> AdapterManager:
    """The manager an entry point uses: blob store from ``settings.resolved_blob_url()``, disk
    cache under ``settings.home / "adapter-cache"`` within ``settings.max_disk_lora_bytes``,
    adapter copies staged under ``settings.staging_dir``.
    ``settings`` is a ``loraplex.config.Settings`` built by the caller. No adapter may take the
    served base model's name (``settings.served_name``), whichever entry point uploads."""
    from loraplex.storage.base import open_blob_store

    blobs = open_blob_store(settings.resolved_blob_url())
    disk_cache = AdapterManager.make_disk_cache(Path(settings.home) / "adapter-cache", settings.max_disk_lora_bytes)
    manager = AdapterManager(
        registry, blobs, disk_cache, spec, settings.max_lora_rank,
        max_member_bytes=settings.max_upload_member_bytes, background_deletes=background_deletes,
        snapshot_root=settings.staging_dir,
    )
    manager.base_model_names = frozenset({settings.served_name})
    return manager
