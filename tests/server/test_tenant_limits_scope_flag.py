"""``--tenant-limits-scope`` (``LORAPLEX_TENANT_LIMITS_SCOPE``): ``replica`` by default, ``cluster``
from the flag or the environment, anything else refused at the parse; ``cluster`` needs a
heartbeat interval; ``run-batch`` has no such flag (a batch applies no tenant limits)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from loraplex.cli import build_parser
from loraplex.config import Settings
from loraplex.server.cli import settings_from_args
from tests.server.cli_parsing import no_cli_env  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("no_cli_env")


def test_the_default_is_per_replica_and_the_flag_or_environment_sets_cluster(monkeypatch):
    assert settings_from_args(build_parser().parse_args(["serve", "m"])).tenant_limits_scope == "replica"
    flagged = build_parser().parse_args(["serve", "m", "--tenant-limits-scope", "cluster"])
    assert settings_from_args(flagged).tenant_limits_scope == "cluster"
    monkeypatch.setenv("LORAPLEX_TENANT_LIMITS_SCOPE", "cluster")
    assert settings_from_args(build_parser().parse_args(["serve", "m"])).tenant_limits_scope == "cluster"


def test_an_unknown_scope_is_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "m", "--tenant-limits-scope", "global"])
    assert exited.value.code == 2
    assert "choose from 'replica', 'cluster'" in capsys.readouterr().err


def test_cluster_scope_needs_a_heartbeat_interval():
    with pytest.raises(ValidationError, match="registry_poll_seconds > 0"):
        Settings(tenant_limits_scope="cluster", registry_poll_seconds=0)
    assert Settings(tenant_limits_scope="replica", registry_poll_seconds=0).registry_poll_seconds == 0


def test_run_batch_has_no_scope_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "--tenant-limits-scope", "cluster"])
    assert "--tenant-limits-scope" in capsys.readouterr().err
