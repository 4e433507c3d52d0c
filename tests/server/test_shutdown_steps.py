"""The lifespan's stop steps (shutdown_steps.py), alone: order, every step run when one fails,
and which error comes out."""

from __future__ import annotations

import asyncio
import logging

from loraplex.server.shutdown_steps import ShutdownSteps


def _steps(calls: list, failing: set[str]) -> ShutdownSteps:
    steps = ShutdownSteps()
    for name in ("engine", "blob gc", "heartbeat"):
        async def stop(name=name):
            calls.append(name)
            if name in failing:
                raise RuntimeError(f"{name} would not stop")
        steps.add(name, stop)
    return steps


def test_steps_run_last_added_first_each_once():
    calls = []
    steps = _steps(calls, set())
    assert steps.names == ["heartbeat", "blob gc", "engine"]
    assert asyncio.run(steps.run()) == []
    assert calls == ["heartbeat", "blob gc", "engine"]
    assert asyncio.run(steps.run()) == [] and calls == ["heartbeat", "blob gc", "engine"]  # nothing left


def test_a_failing_step_does_not_keep_the_others_from_running():
    calls = []
    errors = asyncio.run(_steps(calls, {"heartbeat", "engine"}).run())
    assert calls == ["heartbeat", "blob gc", "engine"]
    assert [(name, str(exc)) for name, exc in errors] == [("heartbeat", "heartbeat would not stop"),
                                                        ("engine", "engine would not stop")]


def test_after_a_failed_start_the_stop_errors_are_logged_not_raised(caplog):
    calls = []
    with caplog.at_level(logging.ERROR, logger="loraplex.server"):
        asyncio.run(_steps(calls, {"blob gc"}).run_after_failed_start())
    assert calls == ["heartbeat", "blob gc", "engine"]
    assert "stopping what had started: heartbeat, blob gc, engine" in caplog.text
    assert any(r.exc_info and str(r.exc_info[1]) == "blob gc would not stop" for r in caplog.records)
