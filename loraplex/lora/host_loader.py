"""Background disk -> host reads of adapters the engine already knows.

An adapter evicted from host memory has to be read again (files, validation, content hash,
``AdapterWeights``) when a request for it comes back. For a rank-16 adapter on every projection
of a Llama-3-8B that is about 84 MB and a quarter of a second here, page cache warm; done on the
engine thread, every running stream would stall that long on each such host miss.
``HostTier`` (host_tier.py) hands those reads to a ``HostLoader`` instead: it submits and collects on the
engine thread, the workers only run the pure read function and touch no manager state. Requests
for an adapter being read wait (the scheduler's gate: not ready) while the others keep decoding.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from loraplex.lora.weights import AdapterWeights


@dataclass
class FinishedRead:
    """One read the workers completed: ``weights`` or the ``error`` the read raised."""

    adapter_id: str
    weights: AdapterWeights | None
    error: BaseException | None
    seconds: float


class HostLoader:
    """Reads adapter files on worker threads. ``read(path, adapter_id)`` must not touch shared
    state (``AdapterCatalog.parse`` reads only fixed configuration). Not thread-safe
    itself: ``submit`` / ``take_finished`` / ``is_reading`` belong to one thread (the engine's);
    ``on_done`` is called on a worker when a read ends, to wake that thread."""

    def __init__(self, read: Callable[[str, str], AdapterWeights], on_done: Callable[[], None] = lambda: None,
                 max_workers: int = 2):
        self._read = read
        self._on_done = on_done
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="loraplex-adapter-read")
        self._pending: dict[str, Future] = {}  # adapter id -> its read
        self._closed = threading.Event()

    def is_reading(self, adapter_id: str) -> bool:
        return adapter_id in self._pending

    @property
    def num_reading(self) -> int:
        return len(self._pending)

    def submit(self, adapter_id: str, path: str) -> None:
        if adapter_id in self._pending:
            return
        future = self._pool.submit(self._timed_read, path, adapter_id)
        self._pending[adapter_id] = future
        future.add_done_callback(lambda _: None if self._closed.is_set() else self._on_done())

    def _timed_read(self, path: str, adapter_id: str) -> tuple[AdapterWeights, float]:
        started = time.perf_counter()
        weights = self._read(path, adapter_id)
        return weights, time.perf_counter() - started

    def take_finished(self) -> list[FinishedRead]:
        """The reads that ended since the last call (in submission order)."""
        out = []
        for adapter_id, future in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[adapter_id]
            try:
                weights, seconds = future.result()
                out.append(FinishedRead(adapter_id, weights, None, seconds))
            except BaseException as exc:  # noqa: BLE001 - handed to the manager, which fails the requests
                out.append(FinishedRead(adapter_id, None, exc, 0.0))
        return out

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every read in flight has ended (for tests and tools); False on timeout."""
        _, not_done = wait(list(self._pending.values()), timeout)
        return not not_done

    def close(self) -> list[str]:
        """Forget the reads in flight (their results are dropped) and stop the workers; returns
        the ids of the reads dropped."""
        self._closed.set()
        dropped = list(self._pending)
        self._pending.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
        return dropped
