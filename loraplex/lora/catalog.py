"""AdapterCatalog: which adapters an engine knows, by content hash, name and directory, and the
reading and validating of adapter files for its base model. ``LoRAManager`` builds the tiers
(host cache, device slots) on top of it."""

from __future__ import annotations

import os
import time
from dataclasses import fields
from pathlib import Path

import torch

from loraplex.lora.errors import AdapterHashMismatchError, AdapterNotFoundError, InvalidAdapterError
from loraplex.lora.peft_format import load_adapter_files, validate_adapter
from loraplex.lora.records import AdapterRecord, AdapterStats, PreparedAdapter, check_hash, files_fingerprint
from loraplex.lora.spec import AdapterRef, LoRATargetSpec
from loraplex.lora.weights import AdapterWeights


class AdapterCatalog:
    """Content hash -> ``AdapterRecord``, registered names, and which unchanged directory holds
    which id (so a known directory is not hashed again). ``parse`` reads only the catalog's fixed
    configuration, so any thread may run it (``read_ahead``, ``HostLoader``); everything else
    belongs to the engine thread."""

    def __init__(self, spec: LoRATargetSpec, max_lora_rank: int, dtype: torch.dtype):
        self.spec = spec
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.records: dict[str, AdapterRecord] = {}
        self.names: dict[str, str] = {}  # registered name -> adapter id
        self._path_memo: dict[str, tuple[tuple, str]] = {}  # path -> (file fingerprint, adapter id)
        self.forgotten = AdapterStats()  # the counters of records dropped by ``forget``, summed

    # ---- files -------------------------------------------------------------------------------
    def parse(self, path: str, expected_id: str | None = None) -> AdapterWeights:
        """Files -> validated host weights; ``expected_id``: the content hash they must have."""
        parsed = load_adapter_files(path)
        info = validate_adapter(parsed, self.spec, self.max_lora_rank)
        if expected_id is not None and info.content_hash != expected_id:
            raise AdapterHashMismatchError(f"adapter files at {path!r} changed since they were loaded")
        return AdapterWeights.build(parsed, info, self.spec, self.dtype)

    def read(self, path: str, expected_id: str | None = None) -> AdapterWeights:
        """``parse``, counted in the adapter's stats when it is known."""
        started = time.perf_counter()
        weights = self.parse(path, expected_id)
        self.count_read(weights.adapter_id, time.perf_counter() - started)
        return weights

    def count_read(self, adapter_id: str, seconds: float) -> None:
        rec = self.records.get(adapter_id)
        if rec is not None:
            rec.stats.host_loads += 1
            rec.stats.load_seconds += seconds

    def read_ahead(self, adapter: None | str | AdapterRef) -> PreparedAdapter | None:
        """Read and validate the files ``resolve`` would read, without touching any state, so a
        caller can do it off the engine thread (reading and hashing a large adapter takes
        seconds that would otherwise stall every running request). None when ``resolve`` needs
        no files (base model, a registered name, a version already known). Raises what
        ``resolve`` would for a bad adapter."""
        if isinstance(adapter, AdapterRef):
            if adapter.content_hash is not None and adapter.content_hash in self.records:
                return None
            path, expected = adapter.path, adapter.content_hash
        elif isinstance(adapter, str) and adapter not in self.names and os.path.isdir(adapter):
            path, expected = adapter, None
        else:
            return None
        path = os.path.abspath(path)
        fingerprint = files_fingerprint(path)
        if self._known_id(path, fingerprint) is not None:
            return None
        started = time.perf_counter()
        weights = self.parse(path)
        check_hash(path, weights.adapter_id, expected)
        return PreparedAdapter(path, fingerprint, weights, time.perf_counter() - started)

    # ---- names and references ----------------------------------------------------------------
    def resolve(self, adapter: None | str | AdapterRef, prepared: PreparedAdapter | None = None
                ) -> tuple[str | None, AdapterWeights | None]:
        """(adapter id, weights read now or None) for a request's adapter: None (base model), a
        registered name, a PEFT directory path, or an ``AdapterRef`` (its ``content_hash`` is
        verified when given). ``prepared`` (from ``read_ahead``) replaces reading the files when
        it still matches them."""
        if adapter is None:
            return None, None
        if isinstance(adapter, AdapterRef):
            if adapter.content_hash is not None and adapter.content_hash in self.records:
                return adapter.content_hash, None
            return self._ensure_known(adapter.path, adapter.name, adapter.content_hash, prepared)
        if isinstance(adapter, str):
            if adapter in self.names:
                return self.names[adapter], None
            if os.path.isdir(adapter):
                return self._ensure_known(adapter, Path(adapter).name, prepared=prepared)
            raise AdapterNotFoundError(f"adapter {adapter!r} is neither a registered name nor a PEFT directory")
        raise InvalidAdapterError(f"adapter must be None, a name, a path or an AdapterRef, not {type(adapter).__name__}")

    def register(self, name: str, path: str | os.PathLike) -> tuple[str, AdapterWeights | None]:
        """Point ``name`` at the adapter in ``path`` (validated first; a rejected adapter leaves
        the previous registration in place): (adapter id, weights read now or None)."""
        adapter_id, weights = self._ensure_known(str(path), name)
        old = self.names.get(name)
        if old is not None and old != adapter_id and old in self.records:
            self.records[old].names.discard(name)
        self.names[name] = adapter_id
        rec = self.records[adapter_id]
        rec.names.add(name)
        rec.display_name = name
        return adapter_id, weights

    def unregister(self, name: str) -> AdapterRecord | None:
        """Forget ``name``; returns the record it pointed at (if still known)."""
        adapter_id = self.names.pop(name, None)
        if adapter_id is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        rec = self.records.get(adapter_id)
        if rec is not None:
            rec.names.discard(name)
        return rec

    def forget(self, adapter_id: str) -> None:
        """Drop ``adapter_id``'s record and the directories remembered as holding it; its
        counters go into ``forgotten``, so totals over every adapter never go back."""
        rec = self.records.pop(adapter_id, None)
        if rec is not None:
            for field in fields(AdapterStats):
                name = field.name
                setattr(self.forgotten, name, getattr(self.forgotten, name) + getattr(rec.stats, name))
        for path in [p for p, (_, aid) in self._path_memo.items() if aid == adapter_id]:
            del self._path_memo[path]

    def _ensure_known(self, path: str, display: str, expected_hash: str | None = None,
                      prepared: PreparedAdapter | None = None) -> tuple[str, AdapterWeights | None]:
        path = os.path.abspath(path)
        fp = files_fingerprint(path)
        adapter_id = self._known_id(path, fp)
        weights = None
        if adapter_id is None:
            started = time.perf_counter()
            if prepared is not None and prepared.path == path and prepared.fingerprint == fp:
                weights, read_seconds = prepared.weights, prepared.read_seconds
            else:
                weights = self.read(path)  # every check runs before any state changes
                read_seconds = time.perf_counter() - started
            adapter_id = weights.adapter_id
            check_hash(path, adapter_id, expected_hash)
            if adapter_id not in self.records:
                self.records[adapter_id] = AdapterRecord(adapter_id, path, weights.info, display, weights.nbytes)
                self.count_read(adapter_id, read_seconds)
            self._path_memo[path] = (fp, adapter_id)
        check_hash(path, adapter_id, expected_hash)
        # reload from the path named last: an older copy of the same bytes may be gone since
        self.records[adapter_id].path = path
        return adapter_id, weights

    def _known_id(self, path: str, fingerprint: tuple) -> str | None:
        """The id already loaded from ``path`` when its files are unchanged, else None."""
        memo = self._path_memo.get(path)
        if memo is not None and memo[0] == fingerprint and memo[1] in self.records:
            return memo[1]
        return None
