"""The lifespan's stop steps (shutdown_steps.py) and the drain's steps (lifecycle.py), alone:
order, every step run when one fails, and which error comes out."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from loraplex.server.lifecycle import Lifecycle
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


def test_drain_runs_its_steps_once_draining_then_waits_for_the_requests():
    async def scenario():
        lifecycle = Lifecycle()
        seen = []

        async def step():
            seen.append(lifecycle.draining)

        async def failing_step():
            raise RuntimeError("database down")

        lifecycle.add_drain_step(failing_step)
        lifecycle.add_drain_step(step)
        lifecycle.admit()
        asyncio.get_running_loop().call_later(0.1, lifecycle.done)
        ok = await lifecycle.drain(5.0)
        return ok, seen

    ok, seen = asyncio.run(scenario())
    assert ok and seen == [True]  # the failing step did not keep the next one or the wait from running


def test_the_drain_steps_time_counts_in_the_grace():
    async def scenario():
        lifecycle = Lifecycle()

        async def slow_step():
            await asyncio.sleep(0.3)

        lifecycle.add_drain_step(slow_step)
        lifecycle.admit()  # never done: the drain times out
        started = time.monotonic()
        ok = await lifecycle.drain(0.5)
        return ok, time.monotonic() - started

    ok, took = asyncio.run(scenario())
    assert not ok
    assert took == pytest.approx(0.5, abs=0.15)


def test_the_cut_runs_its_steps_then_waits_for_the_requests_they_ended(caplog):
    async def scenario():
        lifecycle = Lifecycle()
        for _ in range(3):
            lifecycle.admit()

        async def failing_step():
            raise RuntimeError("engine gone")

        async def end_two():  # two requests it knows of answer a turn later; the third is not its
            asyncio.get_running_loop().call_soon(lifecycle.done)
            asyncio.get_running_loop().call_soon(lifecycle.done)
            return 2

        lifecycle.add_cut_step(failing_step)
        lifecycle.add_cut_step(end_two)
        left_one = await lifecycle.cut(0.2)
        lifecycle.done()
        return left_one, await lifecycle.cut(0.2)

    with caplog.at_level(logging.INFO, logger="loraplex.server"):
        left_one, none_left = asyncio.run(scenario())
    assert (left_one, none_left) == (False, True)
    messages = [r.getMessage() for r in caplog.records]
    assert "drain: a cut step failed" in messages
    assert "drain: 2 request(s) still running at the end of the grace ended with a 503; " \
           "1 still open are cut by the server" in messages
