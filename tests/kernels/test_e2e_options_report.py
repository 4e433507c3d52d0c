"""The GPU check's "Engine options" table (kernels/e2e_bench.py) keeps what it measured when one
setting fails: neither schedule_ahead nor the shrink beside has run on a GPU yet, and one call of
minutes must not lose the other settings' rows to one exception. Greedy tokens that differ from
the first row's are a failure (neither option changes what a step computes)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
CASES = {(4, 0): ("base prompts", None), (4, 2): ("lora prompts", None)}


class _Phases:
    """StepPhases' stand-in: one decode step per run."""

    def __init__(self, llm):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    @staticmethod
    def decode_step_seconds(batch):
        return [0.002]


@pytest.fixture
def e2e(monkeypatch):
    monkeypatch.syspath_prepend(str(KERNELS))
    import e2e_bench
    import step_phases

    monkeypatch.setattr(step_phases, "StepPhases", _Phases)
    yield e2e_bench
    for name in ("e2e_bench", "step_phases"):
        sys.modules.pop(name, None)


def _llm():
    graphs = SimpleNamespace(graphs={}, bucket_for=lambda batch: batch)
    runner = SimpleNamespace(decode_graphs=graphs)
    return SimpleNamespace(engine=SimpleNamespace(runner=runner, schedule_ahead=False, overlap_outputs=True))


def _rows(report) -> dict[str, list[str]]:
    rows = {}
    for line in report.lines:
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if cells and cells[0] in {label for label, _, _ in sys.modules["e2e_bench"].OPTION_SETTINGS}:
            rows[cells[0]] = cells
    return rows


def test_a_setting_that_raises_costs_its_own_rows_only(e2e, monkeypatch):
    from lab_common import Report

    llm = _llm()

    def set_shrink_beside(runner, on_gpu, enabled):
        if enabled:
            raise RuntimeError("capture invalidated")

    monkeypatch.setattr(e2e, "_set_shrink_beside", set_shrink_beside)
    monkeypatch.setattr(e2e, "_timed_generate", lambda llm, prompts, adapters, n: (0.0, [[1, 2]] * 4))
    report = Report("options")
    e2e._report_engine_options(report, llm, CASES, False, 2)
    rows = _rows(report)
    assert rows["shrink beside"][1:] == ["FAILED"] * 6
    assert rows["schedule_ahead + shrink beside"][1:] == ["FAILED"] * 6
    for label in ("as configured", "schedule_ahead"):
        assert rows[label][1:3] == ["2.000", "2.000"] and rows[label][5] == "4 of 4 sequences", rows[label]
    assert report.failures == ["engine option setting 'shrink beside' raised",
                               "engine option setting 'schedule_ahead + shrink beside' raised"]
    assert any("RuntimeError: capture invalidated" in line for line in report.lines)
    assert llm.engine.schedule_ahead is False  # the engine is left as configured


def test_greedy_tokens_that_differ_from_the_first_row_are_a_failure(e2e, monkeypatch):
    from lab_common import Report

    llm = _llm()
    monkeypatch.setattr(e2e, "_set_shrink_beside", lambda runner, on_gpu, enabled: None)

    def generate(llm_, prompts, adapters, n):
        wrong = llm_.engine.schedule_ahead and prompts == "lora prompts"
        return 0.0, [[1, 3] if wrong and i == 0 else [1, 2] for i in range(4)]

    monkeypatch.setattr(e2e, "_timed_generate", generate)
    report = Report("options")
    e2e._report_engine_options(report, llm, CASES, False, 2)
    rows = _rows(report)
    assert rows["schedule_ahead"][6].startswith("3 of 4 sequences; first differing token at step 1")
    assert rows["shrink beside"][6] == "4 of 4 sequences"
    assert report.failures == [
        f"engine option setting {label!r} changed the greedy tokens at batch 4, 2 adapters"
        for label in ("schedule_ahead", "schedule_ahead + shrink beside")
    ]


def test_without_the_first_row_nothing_is_compared(e2e, monkeypatch):
    from lab_common import Report

    def generate(*args):
        raise RuntimeError("engine broken")

    monkeypatch.setattr(e2e, "_set_shrink_beside", lambda runner, on_gpu, enabled: None)
    monkeypatch.setattr(e2e, "_timed_generate", generate)
    report = Report("options")
    e2e._report_engine_options(report, _llm(), CASES, False, 2)
    assert report.failures == ["engine option setting 'as configured' raised"]
    assert _rows(report) == {}
