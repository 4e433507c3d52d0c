"""Fixtures shared by the e2e modules: the OpenAI-compatibility server (see compat_server.py),
started once for test_openai_compat_e2e.py and test_openai_constraints_e2e.py."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.compat_server import build_model_dir, start_compat_server, tenant_client


@pytest.fixture(scope="session")
def compat_model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("compat-model"))


@pytest.fixture(scope="session")
def compat_srv(tmp_path_factory, compat_model_dir):
    server = start_compat_server(tmp_path_factory.mktemp("compat"), compat_model_dir)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def compat_client(compat_srv) -> openai.OpenAI:
    return tenant_client(compat_srv, "compat")
