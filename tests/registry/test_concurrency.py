"""Concurrent writers: uploads get distinct numbers, hot-swaps are atomic, no update is lost."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from loraplex.registry.errors import Conflict
from loraplex.registry.service import RegistryService

from tests.registry.helpers import version_fields

THREADS = 4


def test_concurrent_uploads_get_distinct_numbers(registry_service):
    service = registry_service
    service.create_tenant("acme")
    barrier = threading.Barrier(THREADS)

    def upload(worker: int) -> list[int]:
        barrier.wait()
        numbers = []
        for i in range(3):
            version, created = service.add_version("acme", "sql", **version_fields(f"{worker}-{i}".encode()))
            assert created
            numbers.append(version.version)
        return numbers

    with ThreadPoolExecutor(THREADS) as pool:
        results = [n for numbers in pool.map(upload, range(THREADS)) for n in numbers]
    assert sorted(results) == list(range(1, THREADS * 3 + 1))
    adapter = service.get_adapter("acme", "sql")
    assert [v.version for v in adapter.versions] == list(range(1, THREADS * 3 + 1))
    assert adapter.active_version is not None
    uploads = [e for e in service.list_audit(tenant="acme", limit=1000) if e.action == "adapter.upload"]
    assert len(uploads) == THREADS * 3


def test_concurrent_hot_swaps_and_resolves_stay_consistent(registry_service):
    service = registry_service
    service.create_tenant("acme")
    by_number = {}
    for i in range(3):
        version, _ = service.add_version("acme", "sql", **version_fields(f"w{i}".encode()))
        by_number[version.version] = version.sha256
    start = service.change_counter()
    swaps_per_thread = 5
    stop = threading.Event()
    bad = []

    def swapper(worker: int) -> None:
        for i in range(swaps_per_thread):
            # alternate targets so every call really changes the active version
            target = 1 + (worker + i) % 3
            while True:
                current = service.resolve("acme", "sql").version
                if current != target:
                    break
                target = 1 + target % 3
            service.activate("acme", "sql", target, actor=f"w{worker}")

    def reader() -> None:
        while not stop.is_set():
            version = service.resolve("acme", "sql")
            if by_number[version.version] != version.sha256:
                bad.append(version)

    read_thread = threading.Thread(target=reader)
    read_thread.start()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(swapper, range(2)))
    stop.set()
    read_thread.join()
    assert bad == []
    activations = [e for e in service.list_audit(tenant="acme", limit=1000) if e.action == "adapter.activate"]
    changed = [e for e in activations if e.detail["from"] != e.detail["to"]]
    # every real change bumped the counter exactly once (no lost increments)
    assert service.change_counter() - start == len(changed) - 1  # minus the first upload's activation


# A writer paused between its check and its write, while another writer runs whole: on SQLite
# (no row locks) both used to commit, leaving a name that serves nothing. The pause ends when
# the other writer is done, or after PAUSE_S when it waits on the first one's lock (as it must).
PAUSE_S = 1.5


def _race(first, second, monkeypatch, attribute):
    """Run ``first`` paused after the static ``RegistryService.attribute`` returns, and
    ``second`` during the pause; returns each one's result or exception."""
    original = getattr(RegistryService, attribute)
    second_done = threading.Event()

    def paused(*args, **kwargs):
        result = original(*args, **kwargs)
        if threading.current_thread().name == "first":
            second_done.wait(PAUSE_S)
        return result

    monkeypatch.setattr(RegistryService, attribute, staticmethod(paused))
    outcomes = {}

    def run(name, call):
        try:
            outcomes[name] = call()
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            outcomes[name] = exc
        finally:
            if name == "second":
                second_done.set()

    threads = [threading.Thread(target=run, args=("first", first), name="first")]
    threads[0].start()
    time.sleep(0.2)  # the first writer is in its pause
    threads.append(threading.Thread(target=run, args=("second", second), name="second"))
    threads[1].start()
    for thread in threads:
        thread.join(30)
    monkeypatch.undo()
    return outcomes["first"], outcomes["second"]


def test_a_hot_swap_and_a_delete_of_its_target_version_do_not_both_succeed(registry_service, monkeypatch):
    service = registry_service
    service.create_tenant("acme")
    for seed in (b"one", b"two"):
        service.add_version("acme", "sql", **version_fields(seed))
    swap, delete = _race(lambda: service.activate("acme", "sql", 2), lambda: service.delete_version("acme", "sql", 2),
                         monkeypatch, "_require_live_version")
    # the swap read version 2 live first, so it wins; the delete then finds it active
    assert not isinstance(swap, Exception) and isinstance(delete, Conflict), (swap, delete)
    assert service.resolve("acme", "sql").version == 2


def test_a_hot_swap_racing_the_adapters_delete_leaves_no_stale_active_version(registry_service, monkeypatch):
    service = registry_service
    service.create_tenant("acme")
    for seed in (b"one", b"two"):
        service.add_version("acme", "sql", **version_fields(seed))
    _race(lambda: service.activate("acme", "sql", 2), lambda: service.delete_adapter("acme", "sql"),
          monkeypatch, "_require_live_version")
    assert service.get_adapter("acme", "sql") is None
    # the name, uploaded again, serves its first new version (a stale active 2 served nothing)
    version, _ = service.add_version("acme", "sql", **version_fields(b"three"))
    assert service.resolve("acme", "sql").version == version.version == 3


def test_a_tenant_settings_change_racing_the_tenants_delete_lands_before_it(registry_service, monkeypatch):
    service = registry_service
    service.create_tenant("acme")
    patch, delete = _race(lambda: service.update_tenant_settings("acme", {"scheduling_weight": 7}),
                          lambda: service.delete_tenant("acme"), monkeypatch, "_require_tenant")
    assert not isinstance(delete, Exception), delete
    # serialised: the change lands before the delete (the delete's audit comes last)
    actions = [e.action for e in service.list_audit(tenant="acme", limit=10)]
    assert not isinstance(patch, Exception) and actions.index("tenant.delete") < actions.index("tenant.update")
