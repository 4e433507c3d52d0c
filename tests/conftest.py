"""Shared test setup. Fixture modules live in tests/fixtures/ (one per area)."""

import os

import pytest

# Keep the 2-core CI machine responsive: torch's intra-op pool per test process.
os.environ.setdefault("OMP_NUM_THREADS", "2")

pytest_plugins = [
    "tests.fixtures.pg",
    "tests.fixtures.s3",
    "tests.fixtures.tiny_models",
    "tests.fixtures.peft_adapters",
]


@pytest.fixture
def loraplex_home(tmp_path):
    """A fresh LORAPLEX_HOME for one test."""
    home = tmp_path / "loraplex-home"
    home.mkdir()
    return home
