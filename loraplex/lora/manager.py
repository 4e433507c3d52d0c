"""LoRAManager: adapter names and references -> content hashes, and the device/host tiers.

Tiers (DESIGN.md): device slots (``max_loras``) <- host cache (``host_budget_bytes``) <- the
adapter's local PEFT directory. Everything is keyed by content hash (the adapter id), so a name
re-pointed at new weights can never be served from the old weights' slot.

Request lifecycle, as the engine drives it:

* ``resolve(ref)`` when a request arrives: validates (once per file version) and returns the id;
  ``read_ahead(ref)`` does the file reading and validation first, on any thread.
* ``prefetch(id)`` when the request is queued (once per request): counts it and, if a device slot
  is free (or holds an idle adapter), loads the adapter now, ahead of the step that needs it.
* ``is_ready`` / ``num_reserved_slots``: the scheduler's ``AdapterGate``.
* ``place(ids)`` then ``batch_order_key`` each step: the runner places the step's adapters in
  slots (the scheduler guarantees they fit) and orders the flat batch by (rank, slot);
  ``step_context(token_adapter_ids)`` then returns the ``LoRAStepContext``
  (``prepare_step`` does both).
* ``on_request_finished(id, ...)`` once per request (finished or aborted).

The disk -> host stage is ``HostTier`` (host_tier.py): host entries of adapters with queued
requests and no slot are protected from eviction; when the budget is full of those, others wait
(not ready) and are loaded as room frees up.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict

import torch

from loraplex.config import EngineConfig
from loraplex.lora.context import LoRAStepContext, build_batch_meta
from loraplex.lora.catalog import AdapterCatalog
from loraplex.lora.errors import AdapterBusyError, AdapterLoadFailedError, InvalidAdapterError
from loraplex.lora.host_cache import HostCache
from loraplex.lora.host_tier import HostTier
from loraplex.lora.records import PreparedAdapter, host_budget_bytes
from loraplex.lora.slots import SlotPool, slot_pool_dtype
from loraplex.lora.spec import AdapterRef, LoRATargetSpec


class LoRAManager:
    """Multi-LoRA state of one engine (see module doc). Not thread-safe: call from the engine loop."""

    def __init__(self, spec: LoRATargetSpec, config: EngineConfig, device: torch.device | str, dtype: torch.dtype):
        self.spec = spec
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_lora_rank = config.max_lora_rank
        self.pool = SlotPool(spec, config.max_loras, config.max_lora_rank, self.device,
                             slot_pool_dtype(self.device, dtype))
        self.host = HostCache(host_budget_bytes(config, spec, dtype))
        self.catalog = AdapterCatalog(spec, config.max_lora_rank, dtype)
        self._records = self.catalog.records  # the same dict: adapter id -> AdapterRecord
        self.host_tier = HostTier(self.catalog, self.host, lambda adapter_id: self.pool.slot_of(adapter_id) is not None)
        self._last_step: set[str] = set()
        # the last step's placement and token slots, reused by a step of the same adapters in the
        # same order while the pool's slots stand (a steady decode batch: most steps at load)
        self._placed: tuple[list, int, list[str]] | None = None  # (adapter ids, pool generation, step's adapters)
        self._slotted: tuple[list, int, list[int]] | None = None  # (token adapter ids, pool generation, slots)
        self._queued: "OrderedDict[str, None]" = OrderedDict()  # adapters with requests, by first arrival
        self._device_pinned: set[str] = set()
        self._retiring: set[str] = set()  # retired while held: forgotten once nothing holds them

    # ---- AdapterGate ---------------------------------------------------------------------
    def is_ready(self, adapter_id: str) -> bool:
        """In host memory or already in a device slot: a slot can be filled without disk I/O."""
        return self.host_tier.is_ready(adapter_id)

    def num_reserved_slots(self, running: set[str]) -> int:
        return sum(1 for a in self._device_pinned if a not in running)

    # ---- background reads ----------------------------------------------------------------
    def start_background_reads(self, on_done: Callable[[], None]) -> None:
        """From now on an adapter with requests that is in neither tier is read on a worker
        thread (``on_done`` wakes the engine loop when a read ends) and its requests wait for it,
        instead of every running request waiting while the engine thread reads it."""
        self.host_tier.start_background_reads(on_done)

    def stop_background_reads(self) -> None:
        """Back to reading on the calling thread; reads in flight are dropped (their adapters stay
        wanted, so the next step reads them here)."""
        self.host_tier.stop_background_reads()

    def collect_reads(self) -> list[AdapterLoadFailedError]:
        """On the engine thread, before scheduling: file the reads that ended into host memory
        (and free slots). A read that failed is returned, so the engine fails that adapter's
        requests (nothing of it was kept)."""
        failed = self.host_tier.collect_reads()
        if self.host_tier.loader is not None:
            self._service_wanted()
        if self._retiring:  # one held only by a read in flight goes once the read ends
            self._forget_retired()
        return failed

    # ---- names and references (AdapterCatalog) -------------------------------------------
    def resolve(self, adapter: None | str | AdapterRef, prepared: PreparedAdapter | None = None) -> str | None:
        """Adapter id for a request's adapter (``AdapterCatalog.resolve``); weights read now go
        to host memory."""
        adapter_id, weights = self.catalog.resolve(adapter, prepared)
        if weights is not None:
            self.host_tier.put(weights)
        self._retiring.discard(adapter_id)  # named again (the same weights uploaded anew): kept
        return adapter_id

    def read_ahead(self, adapter: None | str | AdapterRef) -> PreparedAdapter | None:
        """``AdapterCatalog.read_ahead``: the file work of ``resolve``, for any thread."""
        return self.catalog.read_ahead(adapter)

    def register(self, name: str, path: str | os.PathLike) -> str:
        """Point ``name`` at the adapter in ``path`` (a rejected adapter leaves the previous
        registration in place). Returns the adapter id."""
        adapter_id, weights = self.catalog.register(name, path)
        if weights is not None:
            self.host_tier.put(weights)
        return adapter_id

    def unregister(self, name: str) -> None:
        rec = self.catalog.unregister(name)
        if rec is not None and not rec.names and rec.outstanding == 0:
            self.unload(rec.adapter_id)
        self._forget_retired()

    def registered(self) -> dict[str, str]:
        return dict(self.catalog.names)

    def shares_base_kv(self, adapter_id: str) -> bool:
        """The adapter's LoRA cannot change any layer's K/V (``kv_effect``, decided when this
        version was validated): its requests may use the base model's prefix-cache blocks."""
        return not self._records[adapter_id].info.changes_kv

    # ---- loading -------------------------------------------------------------------------
    def _load_slot(self, adapter_id: str, slot: int) -> None:
        weights = self.host_tier.weights_for(adapter_id)
        t0 = time.perf_counter()
        old = self.pool.adapter_in[slot]
        if old is not None:
            self.pool.clear(slot)
            rec_old = self._records.get(old)
            if rec_old is not None:
                rec_old.stats.evictions += 1
                if rec_old.outstanding > 0 and old not in self.host:
                    self.host_tier.wanted[old] = None
        self.pool.write(slot, weights)
        stats = self._records[adapter_id].stats
        stats.loads += 1
        stats.load_seconds += time.perf_counter() - t0

    def _sync_refs(self, adapter_id: str) -> None:
        self.pool.refs[adapter_id] = self._records[adapter_id].outstanding

    def prefetch(self, adapter_id: str) -> None:
        """A request for ``adapter_id`` was queued (call once per request): warm it up now, into
        a free device slot or one whose adapter has no requests, else at least into host memory."""
        rec = self._records[adapter_id]
        rec.outstanding += 1
        newly_queued = adapter_id not in self._queued
        self._queued.setdefault(adapter_id, None)
        self._sync_refs(adapter_id)
        try:
            self._warm(adapter_id)
        except BaseException:
            # the files failed to load (deleted, or changed since they were registered): the
            # request is refused, so it must not stay counted (every load path checks before it
            # changes a slot or the host cache)
            rec.outstanding -= 1
            if newly_queued:
                self._queued.pop(adapter_id, None)
            if rec.outstanding == 0:
                self.host_tier.wanted.pop(adapter_id, None)
            self._sync_refs(adapter_id)
            raise

    def _warm(self, adapter_id: str) -> None:
        if self.pool.slot_of(adapter_id) is not None:
            return
        loader = self.host_tier.loader
        if loader is not None and adapter_id not in self.host:
            if not loader.is_reading(adapter_id):
                self.host_tier.check_could_fit(adapter_id)
                self.host_tier.load(adapter_id)  # a free slot is filled when the read lands
            return
        slot = self.pool.slot_to_fill(self._last_step, idle_only=True)
        if slot is not None:
            self._load_slot(adapter_id, slot)
        elif adapter_id not in self.host:
            self.host_tier.load(adapter_id)

    def load(self, ref: str | AdapterRef, tier: str = "device", pin: bool = False,
             prepared: PreparedAdapter | None = None) -> str:
        """Admin warm-up: put the adapter in ``tier`` ("device" or "host"), pinned if asked.
        ``prepared``: ``read_ahead`` of ``ref``, so a new version is not read here."""
        if tier not in ("device", "host"):
            raise InvalidAdapterError(f"tier must be 'device' or 'host', not {tier!r}", param="tier")
        adapter_id = self.resolve(ref, prepared)
        if tier == "host":
            if adapter_id not in self.host and not self.host_tier.put(self.host_tier.weights_for(adapter_id)):
                raise AdapterBusyError("host cache is full of adapters in use; try again later")
            if pin:
                self.host.pinned.add(adapter_id)
            return adapter_id
        if pin and adapter_id not in self._device_pinned and len(self._device_pinned) >= self.pool.max_loras - 1:
            raise InvalidAdapterError(
                f"at most {self.pool.max_loras - 1} adapters can be pinned to device slots (one stays free)",
                param="pin",
            )
        if self.pool.slot_of(adapter_id) is None:
            slot = self.pool.slot_to_fill(self._last_step)
            if slot is None:
                raise AdapterBusyError("every device slot is in use or pinned; try again later")
            self._load_slot(adapter_id, slot)
        if pin:
            self._device_pinned.add(adapter_id)
            self.pool.pinned.add(adapter_id)
        return adapter_id

    def unload(self, adapter_id: str) -> None:
        """Drop from device and host, pins included. Requests still using it reload it from its
        local copy: running ones when their next step places it; queued ones at once (into host
        memory, or ``host_tier.wanted`` when there is no room), because the scheduler admits a waiting
        request only once its adapter is ready, and nothing else would bring it back."""
        self._device_pinned.discard(adapter_id)
        self.pool.pinned.discard(adapter_id)
        slot = self.pool.slot_of(adapter_id)
        if slot is not None:
            self.pool.clear(slot)
        self.host.remove(adapter_id)
        self.host_tier.wanted.pop(adapter_id, None)
        rec = self._records.get(adapter_id)
        if rec is not None and rec.outstanding > 0:
            self.host_tier.load(adapter_id)

    def forget(self, adapter_id: str) -> bool:
        """Drop an adapter nobody holds from every tier and from the catalog (its record, stats
        and path memo), as if never seen: for adapters that will not come back under this id
        (a forgotten merge). False, and nothing changed, while it has requests, a name, a pin
        or a read in flight."""
        rec = self._records.get(adapter_id)
        if rec is None:
            return True
        loader = self.host_tier.loader
        if (rec.outstanding > 0 or rec.names or adapter_id in self._queued or adapter_id in self._device_pinned
                or adapter_id in self.host.pinned or (loader is not None and loader.is_reading(adapter_id))):
            return False
        self.unload(adapter_id)
        self.pool.refs.pop(adapter_id, None)
        self.catalog.forget(adapter_id)
        return True

    def retire(self, adapter_id: str) -> bool:
        """An adapter that will not be asked for again (its versions were deleted): ``unload``
        it now, and ``forget`` it (record, stats) now or, while a request, name, pin or read in
        flight holds it, as soon as the last of them lets go (unless it is resolved again first).
        True when it was forgotten now."""
        self.unload(adapter_id)
        if self.forget(adapter_id):
            self._retiring.discard(adapter_id)
            return True
        self._retiring.add(adapter_id)
        return False

    def _forget_retired(self) -> None:
        for adapter_id in [a for a in self._retiring if self.forget(a)]:
            self._retiring.discard(adapter_id)

    # ---- per step ------------------------------------------------------------------------
    def place(self, adapter_ids: list[str | None]) -> None:
        """Put this step's adapters (``None`` entries ignored) in device slots; the scheduler
        guarantees they fit. Idempotent within a step."""
        placed = self._placed
        if placed is not None and placed[1] == self.pool.generation and placed[0] == adapter_ids:
            self.pool.touch(placed[2])  # as placing them again would: all resident, nothing to load
            return
        step = list(dict.fromkeys(a for a in adapter_ids if a is not None))
        self._last_step = set(step)
        self._placed = None
        for adapter_id in step:
            if self.pool.slot_of(adapter_id) is None:
                slot = self.pool.slot_to_fill(self._last_step)
                if slot is None:
                    raise RuntimeError(
                        f"{len(step)} adapters in one step do not fit {self.pool.max_loras} device slots "
                        f"({len(self._device_pinned)} pinned): the scheduler must not allow this"
                    )
                try:
                    self._load_slot(adapter_id, slot)  # reads the weights before it changes the slot
                except Exception as exc:  # noqa: BLE001 - the engine drops this adapter's requests
                    raise AdapterLoadFailedError(adapter_id, str(exc)) from exc
        self.pool.touch(step)
        self._placed = (list(adapter_ids), self.pool.generation, step)

    def is_placed(self, adapter_id: str) -> bool:
        """Whether ``adapter_id`` is in a device slot now: a step of it is placed without a load
        (the scheduler's step ahead takes nothing that could fail to load)."""
        return self.pool.slot_of(adapter_id) is not None

    def batch_order_key(self, adapter_id: str | None) -> tuple[int, int]:
        """Sort key for a placed adapter's sequences in the flat batch: base model first, then by
        (rank, slot), so each rank's tokens are one contiguous run in slot order and the CPU
        path reads them as views."""
        if adapter_id is None:
            return (-1, -1)
        slot = self.pool.slot_of(adapter_id)
        return (self.pool.slot_rank_host[slot], slot)

    def prepare_step(self, token_adapter_ids: list[str | None]) -> LoRAStepContext | None:
        """``place`` then ``step_context``, for callers that have not placed the step's adapters."""
        self.place(token_adapter_ids)
        return self.step_context(token_adapter_ids)

    def step_context(self, token_adapter_ids: list[str | None]) -> LoRAStepContext | None:
        """The step's ``LoRAStepContext`` (None when no token uses an adapter) for adapters
        already placed by ``place``. ``token_adapter_ids``: one entry per token of the flat batch."""
        token_slots = self.step_slots(token_adapter_ids)
        if token_slots is None:
            return None
        meta = build_batch_meta(token_slots, self.pool.slot_rank, self.pool.slot_rank_host)
        return LoRAStepContext(self.pool, meta, token_slots=token_slots)

    def step_slots(self, token_adapter_ids: list[str | None]) -> list[int] | None:
        """Each token's device slot (-1 = base model), or None when no token uses an adapter, for
        adapters already placed by ``place``; a CUDA graph builds its own metadata from these.
        The list may be the one an earlier step got (same adapters, same slots): do not change it."""
        token_slots = None
        if self._last_step:
            slotted, generation = self._slotted, self.pool.generation
            if slotted is not None and slotted[1] == generation and slotted[0] == token_adapter_ids:
                token_slots = slotted[2]
            else:
                slot_of = {a: self.pool.slot_of(a) for a in self._last_step}
                token_slots = [-1 if a is None else slot_of[a] for a in token_adapter_ids]
                self._slotted = (list(token_adapter_ids), generation, token_slots)
        self._service_wanted()
        return token_slots

    def on_request_finished(self, adapter_id: str | None, prompt_tokens: int, gen_tokens: int) -> None:
        """A request ended (finished or aborted): release it and count its tokens."""
        if adapter_id is None or adapter_id not in self._records:
            return
        rec = self._records[adapter_id]
        rec.outstanding = max(0, rec.outstanding - 1)
        if rec.outstanding == 0:
            self._queued.pop(adapter_id, None)
        self._sync_refs(adapter_id)
        rec.stats.requests += 1
        rec.stats.prompt_tokens += prompt_tokens
        rec.stats.generation_tokens += gen_tokens
        self._service_wanted()
        if rec.outstanding == 0 and adapter_id in self._retiring:
            self._forget_retired()

    def _service_wanted(self) -> None:
        """Bring queued adapters that lacked host room into host memory, then free slots."""
        self.host_tier.service_wanted()
        # queued adapters (oldest first) into free or idle slots: later steps find them loaded
        for adapter_id in list(self._queued):
            if self.pool.slot_of(adapter_id) is not None or adapter_id not in self.host:
                continue
            slot = self.pool.slot_to_fill(self._last_step, idle_only=True)
            if slot is None:
                break
            self._load_slot(adapter_id, slot)

    # ---- introspection -------------------------------------------------------------------
    def tier_of(self, adapter_id: str) -> str:
        if self.pool.slot_of(adapter_id) is not None:
            return "device"
        return "host" if adapter_id in self.host else "disk"

    def stats(self) -> dict:
        """Per-adapter counters, adapters per tier, slot occupancy and host bytes."""
        adapters = {}
        for aid, rec in self._records.items():
            adapters[aid] = {
                "name": rec.display_name,
                "names": sorted(rec.names),
                "tier": self.tier_of(aid),
                "pinned": aid in self._device_pinned or aid in self.host.pinned,
                "rank": rec.info.rank,
                "outstanding_requests": rec.outstanding,
                "retiring": aid in self._retiring,  # deleted: forgotten once the last holder lets go
                **asdict(rec.stats),
            }
        resident = self.pool.resident()
        return {
            "adapters": adapters,
            # the counters of adapters forgotten since (deleted, forgotten merges), summed
            "forgotten": asdict(self.catalog.forgotten),
            "tiers": {"device": len(resident), "host": len(self.host)},
            "slots": {"max_loras": self.pool.max_loras, "used": len(resident), "pinned": len(self._device_pinned)},
            # device bytes of the slot stacks; vocab_bytes: embed_tokens / lm_head stacks, allocated
            # only once an adapter targeting them is loaded
            "slot_bytes": self.pool.nbytes,
            "slot_vocab_bytes": self.pool.vocab.nbytes,
            "host_bytes": self.host.used_bytes,
            "host_budget_bytes": self.host.budget_bytes,
            "host_reads_in_flight": 0 if self.host_tier.loader is None else self.host_tier.loader.num_reading,
        }
