"""AdapterMerger: LoRAX's per-request ``merged_adapters`` as ordinary adapter versions.

A merge of a tenant's adapters is built once (the math: loraplex/lora/merge.py) on the CPU in
float32, written as a PEFT directory into the adapter manager's disk cache under its own content
hash, and from then on is just another adapter to the engine: read into the host tier (counted
in its bytes), loaded into a device slot and evicted like any other.

The cache key is the constituents' content hashes (the exact versions the names resolved to, in
request order) with the merge's weights, strategy, density and sign method. A hot-swap or a
delete of a constituent changes what its name resolves to, hence the key, so a merge of old
weights is never served again. DARE's random drop is seeded from the key: two identical
requests get identical weights, and so identical outputs.

A request holds its merged version like any version (``acquire`` / ``release`` of the adapter
manager by content hash), so its files stay while it runs; idle merges leave the disk cache by
its LRU budget. Constituents are held only while a merge is built.

Every distinct merge (any other weight) is a new adapter, so what the server remembers of merges
is bounded: at most ``max_per_tenant`` per tenant and ``max_remembered`` in all, least recently
used forgotten first. A forgotten merge's content hash is handed to the server once nobody holds
it (``take_forgotten``), to drop from the engine (``forget_adapters``: its catalog record and
stats) and from the status page's names; its files leave the disk cache at once. Asked again, it
is built again (the same weights: the key seeds DARE).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass

from loraplex.lora.merge import MergeError, MergeParams, merge_adapters, write_adapter_dir
from loraplex.lora.peft_format import inspect_adapter_dir, load_adapter_files, validate_adapter
from loraplex.lora.spec import AdapterRef
from loraplex.registry.errors import InvalidName, NotFound
from loraplex.registry.info import VersionInfo
from loraplex.storage.base import BlobNotFound

KEY_FORMAT = "loraplex-merge-v1"
MAX_REMEMBERED_MERGES = 4096  # keys -> content hashes kept in memory (the files live in the disk cache)
MAX_MERGES_PER_TENANT = 64  # one tenant's distinct merges cannot push out everyone else's
MAX_BUILDS_PER_TENANT = 1  # merges one tenant has built at once (each holds up to 16 adapters in float32)


class MergeBusy(Exception):
    """The tenant already has ``limit`` other merges being built (retry once they are done)."""

    def __init__(self, tenant: str, limit: int):
        super().__init__(f"tenant {tenant!r} already has {limit} merge(s) of other adapters or weights being built")
        self.limit = limit


class UnknownAdapter(NotFound):
    """One of the ids is not an adapter of the tenant (or could never be a name): ``ref``."""

    def __init__(self, ref: str, reason: str):
        super().__init__(reason)
        self.ref = ref


@dataclass(frozen=True)
class MergedVersion:
    """A merge a request runs on: the adapter (acquired: ``release`` its content hash once
    done) and its cache key."""

    ref: AdapterRef
    key: str
    built: bool  # built for this request (False: the cached merge)


def merge_key(versions: list[VersionInfo], params: MergeParams) -> str:
    """The identity of a merge: the constituents' content hashes, in order, and the parameters."""
    doc = {"format": KEY_FORMAT, "adapters": [v.sha256 for v in versions], **params.canonical()}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class AdapterMerger:
    """Builds, caches and hands out merged adapters over an ``AdapterManager``. Thread-safe."""

    def __init__(self, adapters, max_remembered: int = MAX_REMEMBERED_MERGES,
                 max_per_tenant: int = MAX_MERGES_PER_TENANT, max_builds_per_tenant: int = MAX_BUILDS_PER_TENANT):
        self.adapters = adapters  # loraplex.registry.adapter_manager.AdapterManager
        self.max_remembered = max_remembered
        self.max_per_tenant = max_per_tenant
        self.max_builds_per_tenant = max_builds_per_tenant
        self._building: Counter[str] = Counter()  # tenant -> its builds under way
        self._lock = threading.Lock()
        self._merged: OrderedDict[str, str] = OrderedDict()  # merge key -> merged content hash, LRU first
        self._owner: dict[str, str] = {}  # merge key -> tenant
        self._per_tenant: Counter[str] = Counter()  # tenant -> its keys in _merged
        self._forgotten: set[str] = set()  # content hashes of forgotten merges, for take_forgotten
        self._key_locks: dict[str, threading.Lock] = {}  # one build per key at a time
        self._made_of: dict[str, tuple[str, ...]] = {}  # merged content hash -> its constituents' hashes
        # resolve under way -> content hashes ``drop_merges_of`` dropped since it began: a merge it
        # builds from one of them is made of deleted weights, so it is never remembered
        self._dropped_since: dict[int, set[str]] = {}
        self._resolve_ids = itertools.count()
        self.builds = 0
        self.reuses = 0

    def resolve(self, tenant: str, refs: list[str], params: MergeParams) -> MergedVersion:
        """The merge of ``tenant``'s adapters ``refs`` (``name`` or ``name@N`` each), acquired.
        Raises ``UnknownAdapter`` for a name the tenant does not have, ``MergeError``
        when these adapters cannot be merged (nothing is cached then), ``MergeBusy`` when the
        tenant's other builds under way are at ``max_builds_per_tenant`` (a request for a merge
        being built waits for it instead)."""
        with self._lock:  # before the names are read: a delete from here on is seen by the build
            resolve_id = next(self._resolve_ids)
            self._dropped_since[resolve_id] = set()
        try:
            return self._resolve(tenant, refs, params, resolve_id)
        finally:
            with self._lock:
                del self._dropped_since[resolve_id]

    def _resolve(self, tenant: str, refs: list[str], params: MergeParams, resolve_id: int) -> MergedVersion:
        registry = self.adapters.registry
        versions = []
        for ref in refs:
            try:
                versions.append(registry.resolve(tenant, ref))
            except (NotFound, InvalidName) as exc:
                raise UnknownAdapter(ref, str(exc)) from None
        bases = sorted({v.base_model for v in versions})
        if len(bases) > 1:
            raise MergeError(f"adapters of different base models cannot be merged ({', '.join(bases)})")
        ranks = sorted({v.rank for v in versions})
        if len(ranks) > 1:
            raise MergeError(f"adapters of different ranks cannot be merged (ranks {ranks}): "
                             "PEFT and LoRAX need one rank for linear, ties and dare merges")
        key = merge_key(versions, params)
        with self._lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        try:
            with key_lock:
                ref = self._cached(key)
                if ref is not None:
                    with self._lock:
                        self.reuses += 1
                        if key in self._merged:
                            self._merged.move_to_end(key)  # recently used: forgotten last
                    return MergedVersion(ref, key, built=False)
                with self._lock:  # builds are CPU and memory heavy: a tenant runs a bounded number at once
                    if self._building[tenant] >= self.max_builds_per_tenant:
                        raise MergeBusy(tenant, self.max_builds_per_tenant)
                    self._building[tenant] += 1
                try:
                    return MergedVersion(self._build(tenant, versions, params, key, resolve_id), key, built=True)
                finally:
                    with self._lock:
                        self._building[tenant] -= 1
                        if self._building[tenant] <= 0:
                            del self._building[tenant]
        finally:
            with self._lock:  # a request waiting on this lock still holds it; a later one finds the merge
                if self._key_locks.get(key) is key_lock:
                    del self._key_locks[key]

    def drop_merges_of(self, content_hash: str) -> list[str]:
        """Forget every merge this process built from the weights ``content_hash`` (a deleted
        constituent) and remove their files from the disk cache (files a running request holds
        stay until it ends and the cache evicts them; so do merges an earlier process built).
        A merge being built from it now is not remembered once built: its request runs on it,
        then it goes as a merge forgotten past the bounds does (``take_forgotten``).
        Returns the merges' content hashes, for the engine to drop."""
        with self._lock:
            for dropped in self._dropped_since.values():  # merges being built from it: see _build
                dropped.add(content_hash)
            merged = {h for h, parts in self._made_of.items() if content_hash in parts}
            for key in [k for k, h in self._merged.items() if h in merged]:
                self._forget_key(key)
            for h in merged:
                self._made_of.pop(h, None)
                self._forgotten.discard(h)  # the caller drops these itself
        for h in merged:
            self.adapters.disk_cache.remove(h)
        return sorted(merged)

    def take_forgotten(self) -> list[str]:
        """Content hashes of forgotten merges that no request holds now and no remembered merge
        shares, handed over once (their files already left the disk cache): for the server to
        drop from the engine and its names. Held ones are handed over by a later call."""
        with self._lock:
            live = set(self._merged.values())
            self._forgotten -= live  # built again since
            free = sorted(h for h in self._forgotten if self.adapters.in_use(h) == 0)
            self._forgotten.difference_update(free)
        for h in free:
            self.adapters.disk_cache.remove(h)
        return free

    def hand_back(self, content_hashes) -> None:
        """Forgotten merges ``take_forgotten`` gave out that could not be dropped yet (the engine
        still runs them): handed out again later."""
        with self._lock:
            self._forgotten.update(h for h in content_hashes if h not in self._merged.values())

    def remembered_hashes(self) -> set[str]:
        with self._lock:
            return set(self._merged.values())

    def stats(self) -> dict:
        with self._lock:
            return {"builds": self.builds, "reuses": self.reuses, "remembered": len(self._merged),
                    "forgotten_pending": len(self._forgotten)}

    # ---- internals -----------------------------------------------------------------------------

    def _cached(self, key: str) -> AdapterRef | None:
        """The remembered merge, acquired, while its files are still in the disk cache."""
        with self._lock:
            content_hash = self._merged.get(key)
        if content_hash is None:
            return None
        self.adapters.acquire(content_hash)  # pinned first: the check below cannot be undone by an eviction
        path = self.adapters.disk_cache.get(content_hash)
        if path is None:
            self.adapters.release(content_hash)
            return None
        return AdapterRef(name=f"+merged:{key[:12]}", path=str(path), content_hash=content_hash)

    def _local_paths(self, versions: list[VersionInfo], held: list[str]) -> list:
        paths = []
        for v in versions:
            try:
                paths.append(self.adapters.local_path(v, acquire=True))
            except BlobNotFound:
                try:
                    self.adapters.registry.resolve(v.tenant, v.ref)
                except NotFound as exc:  # deleted since it was resolved
                    raise UnknownAdapter(v.adapter, str(exc)) from None
                raise
            held.append(v.sha256)
        return paths

    def _forget_key(self, key: str) -> str:
        """Under ``_lock``: drop one remembered merge; returns its content hash."""
        content_hash = self._merged.pop(key)
        tenant = self._owner.pop(key)
        self._per_tenant[tenant] -= 1
        if self._per_tenant[tenant] <= 0:
            del self._per_tenant[tenant]
        return content_hash

    def _remember(self, tenant: str, key: str, content_hash: str, made_of: tuple[str, ...]) -> None:
        """Under ``_lock``: remember a built merge, forgetting the least recently used ones past
        the tenant's and the global bounds."""
        if key in self._merged:
            self._forget_key(key)
        self._merged[key] = content_hash
        self._owner[key] = tenant
        self._per_tenant[tenant] += 1
        self._made_of[content_hash] = made_of
        while self._per_tenant[tenant] > self.max_per_tenant:
            self._drop(next(k for k in self._merged if self._owner[k] == tenant))
        while len(self._merged) > self.max_remembered:
            self._drop(next(iter(self._merged)))

    def _drop(self, key: str) -> None:
        forgotten = self._forget_key(key)
        if forgotten not in self._merged.values():  # two keys can give the same weights
            self._made_of.pop(forgotten, None)
            self._forgotten.add(forgotten)

    def _build(self, tenant: str, versions: list[VersionInfo], params: MergeParams, key: str,
               resolve_id: int) -> AdapterRef:
        adapters, cache = self.adapters, self.adapters.disk_cache
        held: list[str] = []
        staging = None
        try:
            parts = []
            for path in self._local_paths(versions, held):
                parsed = load_adapter_files(path)
                parts.append((parsed, validate_adapter(parsed, adapters.spec, adapters.max_lora_rank)))
            merged = merge_adapters(parts, params, seed=int(key[:16], 16))
            staging = cache.new_staging_dir()
            write_adapter_dir(merged, staging)
            content_hash = inspect_adapter_dir(staging, adapters.spec, adapters.max_lora_rank).content_hash
            adapters.acquire(content_hash)  # pinned before it is inserted: never evicted in between
            try:
                path = cache.insert(content_hash, staging)
            except BaseException:
                adapters.release(content_hash)
                raise
            staging = None  # insert consumed it
        finally:
            for content_hash_held in held:
                adapters.release(content_hash_held)
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
        made_of = tuple(v.sha256 for v in versions)
        with self._lock:
            if self._dropped_since[resolve_id].isdisjoint(made_of):
                self._remember(tenant, key, content_hash, made_of)
            elif content_hash not in self._merged.values():
                # a constituent was deleted while this was built (drop_merges_of ran before it was
                # remembered): its request runs on it, then it goes as any forgotten merge does
                self._forgotten.add(content_hash)
            self.builds += 1
        return AdapterRef(name=f"+merged:{key[:12]}", path=str(path), content_hash=content_hash)
