"""Usage the database does not take is spooled to disk and replayed, never lost nor counted twice:
UsageRecorder with a UsageSpool against a real registry (SQLite and PostgreSQL) whose usage
table is checked against sums computed here from the requests recorded (``expected``).

* at shutdown with the database down the usage is spooled, and a new recorder on the same
  spool replays it at start;
* a crash between a replayed batch's commit and its file's deletion: replayed again, no-op;
* an unreadable file is set aside (``*.bad``, counted, exported) and the others replay;
* two recorders replaying one spool at once count each batch once;
* at the in-memory bound during an outage, usage is spooled instead of dropped;
* a row the database refuses in a spooled batch is dropped alone, even across a retry."""

from __future__ import annotations

import json
import random
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy.exc import OperationalError

from loraplex.registry.usage import COUNTERS
from loraplex.server.usage_metrics import UsageCollector
from loraplex.server.usage_recorder import UsageRecorder
from loraplex.server.usage_spool import FORMAT_VERSION, UsageSpool

H0 = datetime(2026, 12, 3, 14, tzinfo=timezone.utc)


class Clock:
    def __init__(self):
        self.now = H0.timestamp() + 60

    def __call__(self) -> float:
        return self.now


class Down:
    """A ``write`` in front of the registry that fails, without reaching it, while ``down``
    (or for the calls listed in ``fail_calls``, counted from 0)."""

    def __init__(self, registry, down: bool = False, fail_calls=()):
        self.registry, self.down, self.fail_calls = registry, down, set(fail_calls)
        self.calls: list[str] = []

    def __call__(self, deltas, batch_id):
        self.calls.append(batch_id)
        if self.down or len(self.calls) - 1 in self.fail_calls:
            raise OperationalError("INSERT", {}, Exception("could not connect to server"))
        return self.registry.record_usage(deltas, batch_id)


def make_requests(seed: int, n: int, tenants=("acme", "other")) -> list[tuple]:
    """``n`` finished requests: (tenant, adapter, hours after H0, prompt, completion, ok)."""
    rnd = random.Random(seed)
    return [(rnd.choice(tenants), rnd.choice(["sql", "chat", None]), rnd.randrange(3),
             rnd.randrange(1, 500), rnd.randrange(0, 200), rnd.random() < 0.8) for _ in range(n)]


def play(recorder: UsageRecorder, clock: Clock, requests) -> None:
    for tenant, adapter, hours, prompt, completion, ok in requests:
        clock.now = H0.timestamp() + hours * 3600 + 60
        recorder.record(tenant, adapter, prompt_tokens=prompt, completion_tokens=completion, ok=ok)


def expected(*request_lists) -> dict:
    """The usage table's rows after every request of ``request_lists`` was counted once."""
    rows: dict = {}
    for requests in request_lists:
        for tenant, adapter, hours, prompt, completion, ok in requests:
            hour = (H0 + timedelta(hours=hours)).strftime("%Y-%m-%dT%H:00:00Z")
            row = rows.setdefault((tenant, adapter, hour), [0] * 6)
            base = 0 if ok else 3
            row[base] += 1
            row[base + 1] += prompt
            row[base + 2] += completion
    return rows


def table(registry) -> dict:
    report = registry.usage_report(group_by=["tenant", "adapter", "hour"])
    return {(r["tenant"], r["adapter"], r["hour"]): [r[c] for c in COUNTERS] for r in report.rows}


def spool_at_shutdown(registry, spool: UsageSpool, requests) -> None:
    """A recorder that served ``requests`` and stopped with the database down: one spooled batch."""
    clock = Clock()
    recorder = UsageRecorder(Down(registry, down=True), 3600, clock=clock, spool=spool)
    play(recorder, clock, requests)
    assert recorder.stop() is False


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_usage_left_at_shutdown_is_spooled_and_replayed_at_the_next_start(registry_service, tmp_path, caplog):
    spool = UsageSpool(tmp_path / "usage-spool")
    clock, write = Clock(), Down(registry_service)
    first = UsageRecorder(write, 3600, clock=clock, spool=spool)
    written, unsent, pending = make_requests(1, 30), make_requests(2, 30), make_requests(3, 30)
    play(first, clock, written)
    assert first.flush() is True
    write.down = True
    play(first, clock, unsent)
    assert first.flush() is False  # the batch of `unsent` waits under its id
    play(first, clock, pending)
    with caplog.at_level("ERROR", logger="loraplex.server"):
        assert first.stop() is False
    assert table(registry_service) == expected(written)
    assert any(str(spool.directory) in r.getMessage() and "spooled" in r.getMessage() for r in caplog.records)
    files = spool.files()
    docs = [json.loads(path.read_text()) for path in files]
    assert len(files) == 2 and {d["version"] for d in docs} == {FORMAT_VERSION}
    assert write.calls[-1] in {d["batch_id"] for d in docs}  # the unsent batch keeps the id it was sent under
    assert not [p for p in spool.directory.iterdir() if p not in files]  # no temporary file left

    second = UsageRecorder(registry_service.record_usage, 3600, spool=UsageSpool(spool.directory))
    assert second.stats()["spooled_batches"] == 2
    second.start()  # the thread's first flush replays
    try:
        wait_for(lambda: second.stats()["spooled_batches"] == 0)
    finally:
        assert second.stop() is True
    assert table(registry_service) == expected(written, unsent, pending)
    assert list(spool.directory.iterdir()) == []


class CrashBeforeDelete(UsageSpool):
    """A spool whose process dies right after a batch's commit, before its file is deleted."""

    def remove(self, path):
        raise KeyboardInterrupt("killed")


def test_a_replayed_batch_whose_file_outlived_the_commit_is_not_counted_twice(registry_service, tmp_path):
    spool = UsageSpool(tmp_path / "usage-spool")
    batches = [make_requests(seed, 20) for seed in (4, 5, 6)]
    for requests in batches:
        spool_at_shutdown(registry_service, spool, requests)
    assert spool.count() == 3
    crashing = UsageRecorder(registry_service.record_usage, 3600, spool=CrashBeforeDelete(spool.directory))
    with pytest.raises(KeyboardInterrupt):
        crashing.flush()
    # one batch was committed, and its file is still there
    assert spool.count() == 3 and table(registry_service) in [expected(b) for b in batches]
    restarted = UsageRecorder(registry_service.record_usage, 3600, spool=spool)
    assert restarted.flush() is True
    assert table(registry_service) == expected(*batches)
    assert spool.count() == 0


def test_an_unreadable_spool_file_is_set_aside_and_the_others_replay(registry_service, tmp_path):
    spool = UsageSpool(tmp_path / "usage-spool")
    good = [make_requests(seed, 15) for seed in (7, 8)]
    for requests in good:
        spool_at_shutdown(registry_service, spool, requests)
    whole = spool.files()[0].read_text()
    bad = {
        "0-not-json.json": "{not json",
        "1-truncated.json": whole[: len(whole) // 2],
        "2-future.json": whole.replace(f'"version":{FORMAT_VERSION}', '"version":99'),
        "3-text-counts.json": whole.replace('"requests":', '"requests":"1",  "x":', 1),
    }
    for name, text in bad.items():
        (spool.directory / name).write_text(text)
    assert spool.count() == 6
    recorder = UsageRecorder(registry_service.record_usage, 3600, spool=spool)
    assert recorder.flush() is True
    assert table(registry_service) == expected(*good)
    assert spool.count() == 0 and recorder.stats()["spool_files_set_aside"] == len(bad)
    for name, text in bad.items():  # kept as they were, for a person to look at
        assert (spool.directory / f"{name}.bad").read_text() == text
    metrics = CollectorRegistry()
    metrics.register(UsageCollector(recorder))
    text = generate_latest(metrics).decode()
    assert f"loraplex_usage_spool_files_set_aside_total {len(bad)}.0" in text
    assert "loraplex_usage_spooled_batches 0.0" in text
    assert recorder.flush() is True and recorder.stats()["spool_files_set_aside"] == len(bad)  # not again
    # one with the same name is set aside next to the first, not over it
    (spool.directory / "0-not-json.json").write_text("again")
    assert recorder.flush() is True
    assert (spool.directory / "0-not-json.json.bad").read_text() == bad["0-not-json.json"]
    assert (spool.directory / "0-not-json.json.1.bad").read_text() == "again"


class FirstWriteTogether:
    """A ``write`` whose first call waits for the other recorder's first call: both replay the
    same first file at the same moment."""

    def __init__(self, registry, barrier: threading.Barrier):
        self.registry, self.barrier = registry, barrier
        self.calls: list[str] = []

    def __call__(self, deltas, batch_id):
        self.calls.append(batch_id)
        if len(self.calls) == 1:
            self.barrier.wait(10)
        return self.registry.record_usage(deltas, batch_id)


def test_two_recorders_replaying_one_spool_count_each_batch_once(registry_service, tmp_path):
    directory = tmp_path / "usage-spool"
    batches = [make_requests(seed, 10) for seed in range(10, 16)]
    for requests in batches:
        spool_at_shutdown(registry_service, UsageSpool(directory), requests)
    barrier = threading.Barrier(2)
    writes = [FirstWriteTogether(registry_service, barrier) for _ in range(2)]
    recorders = [UsageRecorder(w, 3600, spool=UsageSpool(directory)) for w in writes]
    errors: list[BaseException] = []

    def replay(recorder):
        try:
            recorder.flush()
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    threads = [threading.Thread(target=replay, args=(r,)) for r in recorders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and writes[0].calls[0] == writes[1].calls[0]  # the same batch, at once
    for _ in range(5):  # a write that lost a lock race (SQLite) waits for the next flush
        if recorders[0].flush():
            break
    assert UsageSpool(directory).count() == 0
    assert table(registry_service) == expected(*batches)


def test_at_the_memory_bound_usage_is_spooled_not_dropped(registry_service, tmp_path):
    spool = UsageSpool(tmp_path / "usage-spool")
    clock, write = Clock(), Down(registry_service, down=True)
    recorder = UsageRecorder(write, 3600, clock=clock, max_pending_rows=4, spool=spool)
    played = []
    for seed in range(20, 35):  # a long outage: every flush fails, far more rows than the bound
        # as many new rows between two flushes as the bound: the thread is woken at the bound
        requests = make_requests(seed, 4, tenants=[f"t{seed}", f"u{seed}"])
        play(recorder, clock, requests)
        played.append(requests)
        assert recorder.pending_rows <= 2 * recorder.max_pending_rows
        assert recorder.flush() is False
    assert recorder.dropped_requests == 0 and spool.count() > 0
    assert recorder.stats()["spooled_batches"] == spool.count()
    write.down = False
    assert recorder.flush() is True
    assert table(registry_service) == expected(*played)
    assert spool.count() == 0 and recorder.pending_rows == 0


def test_reaching_the_bound_wakes_the_thread_to_spool(registry_service, tmp_path):
    spool = UsageSpool(tmp_path / "usage-spool")
    clock = Clock()
    recorder = UsageRecorder(Down(registry_service, down=True), 3600, clock=clock, max_pending_rows=3,
                             spool=spool).start()
    try:
        requests = [(f"t{i}", None, 0, 1, 1, True) for i in range(6)]  # past the bound: three held, three more
        play(recorder, clock, requests)
        wait_for(lambda: spool.count() > 0)  # long before the hour's flush
        assert recorder.dropped_requests == 0
    finally:
        recorder.stop()
    recorder = UsageRecorder(registry_service.record_usage, 3600, spool=spool)
    assert recorder.flush() is True and table(registry_service) == expected(requests)


def test_a_refused_row_of_a_spooled_batch_is_dropped_alone_even_across_a_retry(registry_service, tmp_path):
    spool = UsageSpool(tmp_path / "usage-spool")
    good = make_requests(40, 20)
    refused = [(None, "sql", 0, 17, 19, True)]  # NOT NULL tenant: the database refuses the row
    spool_at_shutdown(registry_service, spool, good + refused)
    rows = len(expected(good)) + 1
    # the whole batch is refused, split into rows; the third row's write fails (database gone)
    write = Down(registry_service, fail_calls=[3])
    recorder = UsageRecorder(write, 3600, spool=spool)
    assert recorder.flush() is False and spool.count() == 1  # kept: not every row is written
    written_before = table(registry_service)
    assert 0 < len(written_before) < rows - 1
    assert recorder.flush() is True  # split again under the same ids: the first rows add nothing
    assert table(registry_service) == expected(good)
    assert recorder.dropped_records >= 1 and spool.count() == 0
