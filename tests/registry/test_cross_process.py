"""A hot-swap made by one process is seen by another within 2 seconds (change-counter polling)."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from loraplex.config import Settings
from loraplex.registry.watch import RegistryWatcher
from tests.registry.helpers import version_fields

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_POLL_SECONDS = Settings.model_fields["registry_poll_seconds"].default


def _reader(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line.strip())


def _next_line(lines: queue.Queue, timeout: float, child: subprocess.Popen) -> str:
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        child.kill()
        raise AssertionError(f"child said nothing for {timeout}s; stderr:\n{child.stderr.read()}") from None


@pytest.mark.slow
def test_hot_swap_in_one_process_is_seen_by_another(registry_url, registry_service):
    service = registry_service
    service.create_tenant("acme")
    service.add_version("acme", "sql", **version_fields(b"one"))
    v2, _ = service.add_version("acme", "sql", **version_fields(b"two"))

    child = subprocess.Popen(
        [sys.executable, "-m", "tests.registry.watch_child", registry_url, "acme", "sql", str(DEFAULT_POLL_SECONDS)],
        cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(child.stdout, lines), daemon=True).start()
    try:
        assert _next_line(lines, 60, child) == "ready 1"
        service.activate("acme", "sql", 2, actor="process-a")
        committed_at = time.time()
        seen = _next_line(lines, 10, child).split()
        assert seen[:3] == ["seen", "2", v2.sha256]
        assert float(seen[3]) - committed_at < 2.0, f"seen after {float(seen[3]) - committed_at:.2f}s"
    finally:
        child.stdin.close()
        child.wait(timeout=30)


def test_watcher_reports_only_changes(registry_service):
    service = registry_service
    service.create_tenant("acme")
    service.add_version("acme", "sql", **version_fields(b"one"))
    service.add_version("acme", "sql", **version_fields(b"two"))
    seen: list[int] = []
    watcher = RegistryWatcher(service, 60, seen.append)
    watcher.last_counter = service.change_counter()
    assert watcher.poll_once() is False and seen == []
    service.activate("acme", "sql", 2)
    assert watcher.poll_once() is True and seen == [service.change_counter()]
    assert watcher.poll_once() is False
    service.delete_version("acme", "sql", 1)
    assert watcher.poll_once() is True and len(seen) == 2


def test_watcher_thread_survives_errors():
    calls = []

    class Flaky:
        def __init__(self):
            self.n = 0

        def change_counter(self):
            self.n += 1
            if self.n == 2:
                raise RuntimeError("database went away")
            return self.n

    def on_change(counter):
        calls.append(counter)
        raise ValueError("callback bug")  # logged, not fatal

    with RegistryWatcher(Flaky(), 0.01, on_change) as watcher:
        deadline = time.time() + 5
        while len(calls) < 2 and time.time() < deadline:
            time.sleep(0.01)
    assert len(calls) >= 2 and watcher._thread is None


def test_a_failed_callback_is_called_again_and_an_outage_is_logged_once(caplog):
    class Counter:
        value, down = 1, False

        def change_counter(self):
            if self.down:
                raise RuntimeError("database went away")
            return self.value

    source, calls = Counter(), []

    def on_change(counter):
        calls.append(counter)
        if len(calls) == 1:
            raise ValueError("engine busy")  # the change is not lost: the next poll calls again

    watcher = RegistryWatcher(source, 60, on_change)
    watcher.last_counter = 1
    source.value = 2
    assert watcher.poll_once() is True and calls == [2]
    assert watcher.poll_once() is True and calls == [2, 2]
    assert watcher.poll_once() is False
    with caplog.at_level("INFO", logger="loraplex.registry.watch"), RegistryWatcher(source, 0.01, on_change):
        source.down = True
        time.sleep(0.3)  # about 30 failed polls
        source.down = False
        deadline = time.time() + 5
        while not any("back after" in r.getMessage() for r in caplog.records) and time.time() < deadline:
            time.sleep(0.01)
    failed = [r for r in caplog.records if "poll failed" in r.getMessage()]
    back = [r.getMessage() for r in caplog.records if "back after" in r.getMessage()]
    assert len(failed) == 1 and len(back) == 1, [r.getMessage() for r in caplog.records]
