"""The GPU check script runs end to end on CPU (interpreter, tiny shapes), so it ships tested."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_cpu_smoke_passes_and_writes_results(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "kernels" / "gpu_check.py"), "--cpu-smoke", "--skip-e2e"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = (tmp_path / "results.md").read_text()
    assert "FAIL" not in results
    # every kernel was checked against its reference
    for name in ("decode qkv shrink", "decode qkv expand", "prefill qkv mixed ranks expand",
                 "bs16 kv write", "bs16 attention", "bs32 attention"):
        assert f"PASS {name}:" in results
    assert "copy bandwidth:" in results and "## Paged attention" in results
