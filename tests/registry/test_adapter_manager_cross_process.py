"""Two processes, one PostgreSQL and one S3 (moto server): a hot-swap made by one is served from
the new weights by the other within 2 seconds, fetched from the shared bucket."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from loraplex.config import Settings
from loraplex.registry.db import upgrade
from loraplex.registry.service import RegistryService
from loraplex.storage.base import open_blob_store
from tests.registry.adapter_manager_helpers import build_adapters, make_manager

REPO_ROOT = Path(__file__).resolve().parents[2]
POLL_SECONDS = Settings.model_fields["registry_poll_seconds"].default


def _next_line(lines: queue.Queue, timeout: float, child: subprocess.Popen) -> str:
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        child.kill()
        raise AssertionError(f"child said nothing for {timeout}s; stderr:\n{child.stderr.read()}") from None


@pytest.mark.slow
@pytest.mark.postgres
def test_hot_swap_seen_by_another_process_via_s3(pg_url, s3_blob_url, s3_env, tmp_path):
    upgrade(pg_url)
    registry = RegistryService.from_url(pg_url)
    registry.create_tenant("acme")
    spec, dirs = build_adapters(tmp_path / "adapters")
    manager = make_manager(registry, open_blob_store(s3_blob_url), tmp_path / "cache-a", spec)
    v1, _ = manager.upload("acme", "support", dirs["a"])
    v2, _ = manager.upload("acme", "support", dirs["b"])

    child = subprocess.Popen(
        [sys.executable, "-m", "tests.registry.adapter_manager_child", pg_url, s3_blob_url,
         str(tmp_path / "cache-b"), "acme", "support", str(POLL_SECONDS)],
        cwd=REPO_ROOT, env=dict(os.environ), text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.strip()) for line in child.stdout], daemon=True).start()
    try:
        assert _next_line(lines, 120, child) == f"ready 1 {v1.sha256}"
        registry.activate("acme", "support", 2, actor="process-a")
        committed_at = time.time()
        seen = _next_line(lines, 20, child).split()
        assert seen[:4] == ["seen", "2", v2.sha256, v2.sha256]  # its files really are version 2
        assert float(seen[4]) - committed_at < 2.0, f"served after {float(seen[4]) - committed_at:.2f}s"
    finally:
        child.stdin.close()
        child.wait(timeout=30)
