"""Fixtures shared by the adapter-manager tests of this folder."""

from __future__ import annotations

import pytest

from tests.registry.adapter_manager_helpers import build_adapters


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """``(spec, {name: adapter dir})``: small PEFT adapters for the registry tests' base shapes."""
    return build_adapters(tmp_path_factory.mktemp("adapters"))


@pytest.fixture
def registry(registry_service):
    """The registry service with tenants ``acme`` and ``other``."""
    registry_service.create_tenant("acme")
    registry_service.create_tenant("other")
    return registry_service
