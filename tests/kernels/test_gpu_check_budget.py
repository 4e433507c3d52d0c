"""The GPU check's end-to-end part stays inside the run's time budget (``--budget-s``, what keeps
the one GPU call under 8 minutes): when the kernel sections have already spent it, the part is
skipped before it writes the Llama-3-8B-shaped model and its 128 adapters (tens of seconds on the
GPU machine, every configuration then skipped anyway), and says so in the report."""

from __future__ import annotations

import sys
import time
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def test_end_to_end_builds_nothing_once_the_budget_is_spent(monkeypatch):
    monkeypatch.syspath_prepend(str(KERNELS))
    import e2e_bench
    from lab_common import Report

    def no_build(*args, **kwargs):
        raise AssertionError("the model and adapters were built after the time budget was spent")

    monkeypatch.setattr(e2e_bench, "_make_model_and_adapters", no_build)
    report = Report("budget")
    e2e_bench.run_e2e(report, False, layers=2, max_tokens=6, prompt_len=8, targets="all", deadline=time.time() - 1)
    assert any("time budget" in line and "not run" in line for line in report.lines)
    assert report.failures == []
    sys.modules.pop("e2e_bench", None)
