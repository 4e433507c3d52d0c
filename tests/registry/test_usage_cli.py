"""``loraplex usage`` through ``loraplex.cli.main`` on a temp home: the table and the JSON match
the usage recorded in the database; bad arguments are one error line and exit status 1."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from loraplex.cli import main
from loraplex.config import Settings
from loraplex.registry import db
from loraplex.registry.service import RegistryService
from loraplex.registry.usage import UsageDelta

H0 = datetime(2026, 12, 3, 23, tzinfo=timezone.utc)
H1 = H0 + timedelta(hours=1)


@pytest.fixture
def registry(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LORAPLEX_DATABASE_URL", raising=False)
    url = Settings().resolved_database_url()
    db.upgrade(url)
    service = RegistryService.from_url(url)
    service.record_usage([
        UsageDelta("acme", "sql", H0, requests=3, prompt_tokens=30, completion_tokens=12),
        UsageDelta("acme", None, H1, requests=1, prompt_tokens=5, completion_tokens=1, failed_requests=2),
        UsageDelta("globex", "sql", H1, requests=10, prompt_tokens=100, completion_tokens=50),
    ])
    return service


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _table(out: str) -> list[list[str]]:
    return [line.split() for line in out.strip().splitlines()]


def test_table_by_tenant_and_adapter(registry, capsys):
    code, out, _ = run(capsys, "usage", "--group-by", "tenant,adapter")
    assert code == 0
    assert _table(out) == [
        ["tenant", "adapter", "requests", "prompt_tokens", "completion_tokens", "total_tokens", "failed_requests"],
        ["acme", "(base", "model)", "1", "5", "1", "6", "2"],
        ["acme", "sql", "3", "30", "12", "42", "0"],
        ["globex", "sql", "10", "100", "50", "150", "0"],
        ["total", "14", "135", "63", "198", "2"],
    ]
    code, out, _ = run(capsys, "usage", "--tenant", "acme")
    assert code == 0 and _table(out)[1] == ["4", "35", "13", "48", "2"]


def test_json_is_the_registry_report(registry, capsys):
    code, out, _ = run(capsys, "usage", "--group-by", "day", "--group-by", "tenant", "--start", "2026-12-04T00Z",
                       "--json")
    assert code == 0
    body = json.loads(out)
    assert body == registry.usage_report(start=H1, group_by=["day", "tenant"]).to_dict()
    assert [(r["day"], r["tenant"], r["requests"]) for r in body["data"]] == [("2026-12-04", "acme", 1),
                                                                           ("2026-12-04", "globex", 10)]
    assert body["start"] == "2026-12-04T00:00:00Z" and body["totals"]["requests"] == 11


@pytest.mark.parametrize("argv, words", [
    (["--start", "2026-12-03T23:30Z"], "`--start` must be on the hour"),
    (["--end", "soon"], "`--end` must be an ISO 8601"),
    (["--group-by", "week"], "`group_by` takes"),
    (["--tenant", "Bad Name"], "tenant name"),
])
def test_bad_arguments(registry, capsys, argv, words):
    code, out, err = run(capsys, "usage", *argv)
    assert code == 1 and out == "" and err.startswith("error: ") and words in err
