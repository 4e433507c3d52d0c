"""The disk -> host memory stage of the adapter tiers (``LoRAManager`` drives it).

An adapter with requests that is in neither host memory nor a device slot is read into the host
cache: on the calling thread, or (``start_background_reads``) on a ``HostLoader`` worker into
room reserved for it. When there is no room, or while the read runs, the adapter waits in
``wanted``, oldest first; ``service_wanted`` retries them as room frees up. Host entries of
adapters with requests and no slot are protected from eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from loraplex.lora.catalog import AdapterCatalog
from loraplex.lora.errors import AdapterBusyError, AdapterLoadFailedError
from loraplex.lora.host_cache import HostCache
from loraplex.lora.host_loader import HostLoader
from loraplex.lora.weights import AdapterWeights


class HostTier:
    """Fills ``cache`` from the adapters' files for the adapters of ``catalog``; ``in_slot``
    says whether an adapter is in a device slot (then it needs no host copy to be served).
    Not thread-safe: call from the engine loop."""

    def __init__(self, catalog: AdapterCatalog, cache: HostCache, in_slot: Callable[[str], bool]):
        self.catalog = catalog
        self.cache = cache
        self._records = catalog.records  # the same dict: adapter id -> AdapterRecord
        self._in_slot = in_slot
        # adapters with requests, not in host memory: no room yet, or being read (``loader``)
        self.wanted: "OrderedDict[str, None]" = OrderedDict()
        self.loader: HostLoader | None = None  # set: host misses are read off the engine thread

    def is_ready(self, adapter_id: str) -> bool:
        """In host memory or already in a device slot: a slot can be filled without disk I/O."""
        return adapter_id in self.cache or self._in_slot(adapter_id)

    # ---- background reads ----------------------------------------------------------------
    def start_background_reads(self, on_done: Callable[[], None]) -> None:
        """See ``LoRAManager.start_background_reads``."""
        if self.loader is None:
            self.loader = HostLoader(lambda path, adapter_id: self.catalog.parse(path, adapter_id), on_done)

    def stop_background_reads(self) -> None:
        """Back to reading on the calling thread; reads in flight are dropped (their adapters stay
        wanted, so the next step reads them here)."""
        if self.loader is not None:
            for adapter_id in self.loader.close():
                self.cache.cancel(adapter_id)
                # a request that came while the read ran did not queue it again (``_warm``)
                rec = self._records.get(adapter_id)
                if rec is not None and rec.outstanding > 0:
                    self.wanted[adapter_id] = None
            self.loader = None

    def collect_reads(self) -> list[AdapterLoadFailedError]:
        """File the reads that ended into host memory; a read that failed is returned, so the
        engine fails that adapter's requests (nothing of it was kept)."""
        if self.loader is None:
            return []
        failed = []
        for done in self.loader.take_finished():
            if done.error is not None:
                self.cache.cancel(done.adapter_id)
                self.wanted.pop(done.adapter_id, None)
                if self.is_ready(done.adapter_id):  # loaded meanwhile (an operator's load): serving
                    continue
                error = AdapterLoadFailedError(done.adapter_id, str(done.error))
                error.__cause__ = done.error
                failed.append(error)
                continue
            self.catalog.count_read(done.adapter_id, done.seconds)
            if self._records[done.adapter_id].outstanding > 0:
                self.put(done.weights)  # into its reservation
            else:  # nobody waits for it any more (aborted, or unloaded meanwhile): not kept
                self.cache.cancel(done.adapter_id)
        return failed

    # ---- loading -------------------------------------------------------------------------
    def _protected(self, adapter_id: str) -> bool:
        rec = self._records.get(adapter_id)
        return rec is not None and rec.outstanding > 0 and not self._in_slot(adapter_id)

    def _count_evictions(self, evicted: list[str]) -> None:
        for other in evicted:
            if other in self._records:
                self._records[other].stats.host_evictions += 1

    def put(self, weights: AdapterWeights) -> bool:
        """Store ``weights`` (evicting unprotected entries as needed); when there is no room and
        the adapter has requests, it waits in ``wanted``. Whether it was stored."""
        stored, evicted = self.cache.put(weights, self._protected)
        self._count_evictions(evicted)
        if stored:
            self.wanted.pop(weights.adapter_id, None)
        elif self._records[weights.adapter_id].outstanding > 0:
            self.wanted[weights.adapter_id] = None
        return stored

    def load(self, adapter_id: str) -> bool:
        """Disk -> host for an adapter with requests; when there is no room now, it is queued
        (``wanted``) without reading the files."""
        rec = self._records[adapter_id]
        nbytes = rec.host_bytes
        if self.loader is not None:  # lands in ``collect_reads``, into room held for it meanwhile
            reserved = False
            if not self._waits_behind(adapter_id):
                reserved, evicted = self.cache.reserve(adapter_id, nbytes, self._protected)
                self._count_evictions(evicted)
            if reserved:
                self.loader.submit(adapter_id, rec.path)
            if rec.outstanding > 0:
                self.wanted[adapter_id] = None
            return False
        if not self.cache.can_fit(nbytes, self._protected):
            if rec.outstanding > 0:
                self.wanted[adapter_id] = None
            return False
        return self.put(self.catalog.read(rec.path, expected_id=adapter_id))

    def check_could_fit(self, adapter_id: str) -> None:
        """Refuse a request (409, transient) for an adapter that host pins leave no room to be
        read into: it would wait for as long as they stay."""
        nbytes = self._records[adapter_id].host_bytes
        if not self.cache.could_fit(nbytes):
            raise AdapterBusyError(
                f"adapter needs {nbytes} bytes of host memory; adapters pinned there leave too little of "
                f"the {self.cache.budget_bytes}-byte budget: unpin one, or try again later", param="model")

    def _waits_behind(self, adapter_id: str) -> bool:
        """Whether an adapter queued before ``adapter_id`` (or any, if it is not queued) still
        waits for host room: room that frees up is then that one's. Taking it first would let
        steady traffic to small adapters keep a large one out for ever."""
        for other in self.wanted:
            if other == adapter_id:
                return False
            if not self.loader.is_reading(other) and not self.is_ready(other):
                rec = self._records.get(other)
                # one that host pins leave no room for would hold everyone behind it for ever
                if rec is not None and rec.outstanding > 0 and self.cache.could_fit(rec.host_bytes):
                    return True
        return False

    def weights_for(self, adapter_id: str) -> AdapterWeights:
        """The adapter's weights: the host copy, else read now (and offered to the cache)."""
        w = self.cache.get(adapter_id)
        if w is None:
            rec = self._records[adapter_id]
            w = self.catalog.read(rec.path, expected_id=adapter_id)
            self.put(w)
        return w

    def service_wanted(self) -> None:
        """Bring queued adapters that lacked host room into host memory, oldest first."""
        for adapter_id in list(self.wanted):
            rec = self._records.get(adapter_id)
            if rec is None or rec.outstanding == 0 or self.is_ready(adapter_id):
                self.wanted.pop(adapter_id, None)
                continue
            if self.loader is not None and self.loader.is_reading(adapter_id):
                continue
            if not self.load(adapter_id) and not (self.loader and self.loader.is_reading(adapter_id)):
                break  # no room: the oldest waits first
