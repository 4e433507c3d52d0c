"""Usage accounting in the registry: additive upserts checked against the table's contents,
concurrent writers (threads, and processes with their own engines) adding up exactly, usage
kept after the adapter is deleted, and reports with filters, grouping and bad arguments."""

from __future__ import annotations

import subprocess
import sys
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import select

from loraplex.registry.errors import InvalidName, InvalidSetting
from loraplex.registry.models import UsageHour, as_utc
from loraplex.registry.usage import UsageDelta, hour_of, parse_group_by, parse_hour
from tests.registry.helpers import version_fields

REPO_ROOT = Path(__file__).resolve().parents[2]
H0 = datetime(2026, 12, 3, 22, tzinfo=timezone.utc)  # two hours before midnight: day grouping splits
H1, H2 = H0 + timedelta(hours=1), H0 + timedelta(hours=2)


def _table(service) -> dict[tuple, tuple]:
    """The usage table as stored: (tenant, adapter, hour) -> counters."""
    with service._transaction() as session:
        rows = session.execute(select(UsageHour)).scalars().all()
        return {
            (r.tenant, r.adapter, as_utc(r.hour)): (r.requests, r.prompt_tokens, r.completion_tokens,
                                                    r.failed_requests, r.failed_prompt_tokens, r.failed_completion_tokens)
            for r in rows
        }


def writer_batch(who: str, i: int) -> list[UsageDelta]:
    """One writer's i-th batch: the same three rows every writer adds to, plus one of its own."""
    return [
        UsageDelta("acme", "sql", H0, requests=1, prompt_tokens=10, completion_tokens=i % 7),
        UsageDelta("acme", None, H0, requests=2, prompt_tokens=3, failed_requests=1, failed_completion_tokens=1),
        UsageDelta("other", "sql", H1, requests=1, completion_tokens=5),
        UsageDelta(f"w-{who}", "sql", H1, requests=1),
    ]


def _expected_sums(writers: dict[str, int]) -> dict[tuple, tuple]:
    expected: dict[tuple, list] = {}
    for who, batches in writers.items():
        for i in range(batches):
            for d in writer_batch(who, i):
                key = (d.tenant, d.adapter or "", d.hour)
                row = expected.setdefault(key, [0] * 6)
                for j, v in enumerate(d.counts().values()):
                    row[j] += v
    return {k: tuple(v) for k, v in expected.items()}


def test_upserts_add_and_base_model_is_its_own_row(registry_service):
    registry_service.record_usage([UsageDelta("acme", "sql", H0 + timedelta(minutes=59), requests=1, prompt_tokens=7,
                                              completion_tokens=3)])
    registry_service.record_usage([
        UsageDelta("acme", "sql", H0, requests=2, prompt_tokens=5, completion_tokens=4),
        UsageDelta("acme", "sql", H0, failed_requests=1, failed_prompt_tokens=9, failed_completion_tokens=2),
        UsageDelta("acme", None, H0, requests=1, prompt_tokens=1),
        UsageDelta("acme", "sql", H1, requests=1, completion_tokens=1),
    ])
    registry_service.record_usage([])  # nothing to add: no transaction, no error
    assert _table(registry_service) == {
        ("acme", "sql", H0): (3, 12, 7, 1, 9, 2),  # the 22:59 request is in the 22:00 row
        ("acme", "", H0): (1, 1, 0, 0, 0, 0),
        ("acme", "sql", H1): (1, 0, 1, 0, 0, 0),
    }


def test_bad_deltas_change_nothing(registry_service):
    registry_service.record_usage([UsageDelta("acme", "sql", H0, requests=1)])
    for bad in (-1, 1.5, True, None):
        with pytest.raises(InvalidSetting):
            registry_service.record_usage([UsageDelta("acme", "sql", H0, requests=1),
                                           UsageDelta("acme", "sql", H1, prompt_tokens=bad)])
    assert _table(registry_service) == {("acme", "sql", H0): (1, 0, 0, 0, 0, 0)}


def test_threads_adding_to_the_same_rows_add_up_exactly(registry_service):
    writers = {str(w): 15 for w in range(4)}
    errors = []

    def write(who: str) -> None:
        try:
            for i in range(writers[who]):
                registry_service.record_usage(writer_batch(who, i))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(w,)) for w in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert _table(registry_service) == _expected_sums(writers)


def test_processes_adding_to_the_same_rows_add_up_exactly(registry_url, registry_service):
    writers = {"a": 25, "b": 25, "parent": 25}
    children = [
        subprocess.Popen([sys.executable, "-m", "tests.registry.usage_child", registry_url, str(n), who],
                         cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for who, n in writers.items() if who != "parent"
    ]
    try:
        for child in children:
            assert child.stdout.readline().strip() == "ready", child.stderr.read()
        for child in children:  # go: all write at once
            child.stdin.write("go\n")
            child.stdin.flush()
        for i in range(writers["parent"]):
            registry_service.record_usage(writer_batch("parent", i))
        for child in children:
            out, err = child.communicate(timeout=120)
            assert child.returncode == 0 and out.strip() == "done", err
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    assert _table(registry_service) == _expected_sums(writers)


def test_usage_outlives_the_adapter(registry_service):
    registry_service.create_tenant("acme")
    registry_service.add_version("acme", "sql", **version_fields(b"one"))
    registry_service.record_usage([UsageDelta("acme", "sql", H0, requests=2, prompt_tokens=4, completion_tokens=6)])
    registry_service.delete_adapter("acme", "sql")
    report = registry_service.usage_report(tenant="acme", group_by=["adapter"])
    assert report.rows == [{"adapter": "sql", "requests": 2, "prompt_tokens": 4, "completion_tokens": 6,
                            "failed_requests": 0, "failed_prompt_tokens": 0, "failed_completion_tokens": 0,
                            "total_tokens": 10}]


def _fill(service) -> None:
    service.record_usage([
        UsageDelta("acme", "sql", H0, requests=1, prompt_tokens=10, completion_tokens=1),
        UsageDelta("acme", "sql", H1, requests=2, prompt_tokens=20, completion_tokens=2),
        UsageDelta("acme", None, H2, requests=4, prompt_tokens=40, completion_tokens=4),
        UsageDelta("other", "sql", H2, requests=8, prompt_tokens=80, completion_tokens=8, failed_requests=1),
    ])


def _pick(report, *names):
    return [tuple(row[n] for n in names) for row in report.rows]


def test_report_filters_and_groups(registry_service):
    _fill(registry_service)
    everything = registry_service.usage_report()
    assert _pick(everything, "requests", "prompt_tokens", "completion_tokens", "failed_requests") == [(15, 150, 15, 1)]
    assert everything.totals["total_tokens"] == 165 and everything.totals["requests"] == 15

    by_tenant_adapter = registry_service.usage_report(group_by=["tenant,adapter"])
    assert _pick(by_tenant_adapter, "tenant", "adapter", "requests") == [("acme", None, 4), ("acme", "sql", 3),
                                                                         ("other", "sql", 8)]
    by_day = registry_service.usage_report(group_by=["day"])  # 22:00 and 23:00 on the 3rd, 00:00 on the 4th
    assert _pick(by_day, "day", "requests") == [("2026-12-03", 3), ("2026-12-04", 12)]
    by_hour = registry_service.usage_report(tenant="acme", group_by=["hour"])
    assert _pick(by_hour, "hour", "requests") == [("2026-12-03T22:00:00Z", 1), ("2026-12-03T23:00:00Z", 2),
                                                  ("2026-12-04T00:00:00Z", 4)]

    window = registry_service.usage_report(start=H1, end=H2, group_by=["tenant"])  # end is exclusive
    assert _pick(window, "tenant", "requests") == [("acme", 2)]
    assert registry_service.usage_report(adapter="sql", start=H1).totals["requests"] == 10
    empty = registry_service.usage_report(tenant="nobody")
    assert empty.rows == [] and empty.totals["requests"] == 0 and empty.totals["total_tokens"] == 0
    assert empty.to_dict()["object"] == "usage"


def test_report_refuses_bad_arguments(registry_service):
    with pytest.raises(InvalidSetting) as info:
        registry_service.usage_report(group_by=["tenant,week"])
    assert info.value.param == "group_by"
    with pytest.raises(InvalidSetting) as info:
        registry_service.usage_report(group_by=["hour", "day"])
    assert info.value.param == "group_by"
    with pytest.raises(InvalidSetting) as info:
        registry_service.usage_report(start=H1, end=H0)
    assert info.value.param == "end"
    with pytest.raises(InvalidSetting) as info:
        registry_service.usage_report(start=H0 + timedelta(minutes=1))
    assert info.value.param == "start"
    with pytest.raises(InvalidName):
        registry_service.usage_report(tenant="Not A Name")


def test_parse_hour_and_group_by():
    assert parse_hour("2026-12-03T22:00:00Z", "start") == H0
    assert parse_hour("2026-12-03T22", "start") == H0
    assert parse_hour("2026-12-03T23:00+01:00", "start") == H0
    assert parse_hour("2026-12-04", "end") == H2
    for bad in ("2026-12-03T22:30Z", "yesterday", "", "2026-13-01", "2026-12-03T22:00+00:30"):
        with pytest.raises(InvalidSetting) as info:
            parse_hour(bad, "end")
        assert info.value.param == "end" and "`end`" in str(info.value)
    assert parse_group_by(["tenant, adapter", "tenant", ""]) == ("tenant", "adapter")
    assert hour_of(H0.timestamp() + 3599.9) == H0 and hour_of(H0.timestamp() + 3600) == H1


def test_report_bounds_in_another_time_zone_mean_the_same_hours(registry_service):
    # the same instants written with a +05:00 offset: SQLite used to compare their wall clock
    # (five hours later) with the stored UTC hours and found nothing
    registry_service.record_usage([UsageDelta("acme", None, H0, requests=1), UsageDelta("acme", None, H1, requests=10)])
    plus5 = timezone(timedelta(hours=5))
    report = registry_service.usage_report(start=H0.astimezone(plus5), end=H1.astimezone(plus5))
    assert report.totals["requests"] == 1  # H0 in, H1 (end, exclusive) out
    assert report.start == H0 and report.end == H1
