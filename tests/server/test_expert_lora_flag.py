"""``--enable-expert-lora`` (``LORAPLEX_ENABLE_EXPERT_LORA``, the engine's ``enable_expert_lora``):
off by default, since every LoRA slot then holds every expert's A and B; on, it reaches the engine."""

from __future__ import annotations

import pytest

from loraplex.cli import build_parser
from loraplex.server.cli import settings_from_args
from tests.server.cli_parsing import no_cli_env  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("no_cli_env")


def test_flag_reaches_the_engine_config(monkeypatch):
    on = settings_from_args(build_parser().parse_args(["serve", "m", "--enable-expert-lora"]))
    assert on.enable_expert_lora and on.engine_config().enable_expert_lora
    assert not settings_from_args(build_parser().parse_args(["serve", "m"])).engine_config().enable_expert_lora
    monkeypatch.setenv("LORAPLEX_ENABLE_EXPERT_LORA", "true")
    assert settings_from_args(build_parser().parse_args(["serve", "m"])).engine_config().enable_expert_lora
