"""``loraplex tenants set`` and ``tenants list``: per-tenant limits from the shell, checked
against what the registry then holds."""

from __future__ import annotations

import json

import pytest

from loraplex.cli import main
from loraplex.config import Settings
from loraplex.registry.service import RegistryService


@pytest.fixture
def home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("LORAPLEX_HOME", str(home))
    monkeypatch.delenv("LORAPLEX_DATABASE_URL", raising=False)
    return home


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _held(name: str) -> tuple:
    info = RegistryService.from_url(Settings().resolved_database_url()).get_tenant(name)
    return info.max_concurrent_requests, info.scheduling_weight


def _rates_held(name: str) -> tuple:
    info = RegistryService.from_url(Settings().resolved_database_url()).get_tenant(name)
    return info.max_requests_per_minute, info.max_tokens_per_minute


def test_set_list_and_restore_the_default(home, capsys):
    assert run(capsys, "tenants", "create", "batch")[0] == 0
    code, out, _ = run(capsys, "tenants", "list")
    assert code == 0 and "max_concurrent_requests=default" in out and "scheduling_weight=1" in out

    code, out, _ = run(capsys, "tenants", "set", "batch", "--max-concurrent-requests", "2", "--scheduling-weight", "0.5")
    assert code == 0 and "max_concurrent_requests=2" in out and "scheduling_weight=0.5" in out
    assert _held("batch") == (2, 0.5)
    code, out, _ = run(capsys, "tenants", "set", "batch", "--scheduling-weight", "3")  # the cap is kept
    assert code == 0 and _held("batch") == (2, 3.0)
    code, out, _ = run(capsys, "tenants", "set", "batch", "--max-concurrent-requests", "default")
    assert code == 0 and _held("batch") == (None, 3.0)

    code, out, _ = run(capsys, "tenants", "list", "--json")
    assert [(t["name"], t["max_concurrent_requests"], t["scheduling_weight"]) for t in json.loads(out)] == [
        ("batch", None, 3.0)]
    events = RegistryService.from_url(Settings().resolved_database_url()).list_audit("batch")
    assert [(e.action, e.actor) for e in events][:3] == [("tenant.update", "cli")] * 3


@pytest.mark.parametrize("argv,message", [
    (["--scheduling-weight", "0"], "scheduling_weight"),
    (["--scheduling-weight", "nan"], "scheduling_weight"),
    (["--max-concurrent-requests", "0"], "max_concurrent_requests"),
    (["--max-requests-per-minute", "0"], "max_requests_per_minute"),
    (["--max-tokens-per-minute", "1000000001"], "max_tokens_per_minute"),
    ([], "nothing to change"),
])
def test_bad_values_are_one_clear_line_and_change_nothing(home, capsys, argv, message):
    assert run(capsys, "tenants", "create", "batch")[0] == 0
    code, out, err = run(capsys, "tenants", "set", "batch", *argv)
    assert code == 1 and err.startswith("error: ") and message in err and err.count("\n") == 1
    assert _held("batch") == (None, 1.0) and _rates_held("batch") == (None, None)


def test_unknown_tenant_and_unparseable_cap(home, capsys):
    code, _, err = run(capsys, "tenants", "set", "nobody", "--scheduling-weight", "2")
    assert code == 1 and "not found" in err
    with pytest.raises(SystemExit) as exit_:
        main(["tenants", "set", "nobody", "--max-concurrent-requests", "lots"])
    assert exit_.value.code == 2 and "'default'" in capsys.readouterr().err


def test_rate_limits_set_listed_and_made_unlimited(home, capsys):
    assert run(capsys, "tenants", "create", "batch")[0] == 0
    code, out, _ = run(capsys, "tenants", "list")
    assert "max_requests_per_minute=unlimited" in out and "max_tokens_per_minute=unlimited" in out
    code, out, _ = run(capsys, "tenants", "set", "batch", "--max-requests-per-minute", "30",
                       "--max-tokens-per-minute", "9000")
    assert code == 0 and "max_requests_per_minute=30" in out and "max_tokens_per_minute=9000" in out
    assert _rates_held("batch") == (30, 9000) and _held("batch") == (None, 1.0)
    code, out, _ = run(capsys, "tenants", "set", "batch", "--max-tokens-per-minute", "unlimited")
    assert code == 0 and _rates_held("batch") == (30, None)
    code, out, _ = run(capsys, "tenants", "list", "--json")
    row = json.loads(out)[0]
    assert (row["max_requests_per_minute"], row["max_tokens_per_minute"]) == (30, None)
    with pytest.raises(SystemExit) as exit_:
        main(["tenants", "set", "batch", "--max-requests-per-minute", "lots"])
    assert exit_.value.code == 2 and "'unlimited'" in capsys.readouterr().err
    assert _rates_held("batch") == (30, None)
