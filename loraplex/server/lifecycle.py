"""Readiness, in-flight accounting and the SIGTERM drain.

On SIGTERM (or SIGINT) the server stops admitting: ``/ready`` answers 503 and new generation
requests get 503, while requests already admitted (streams included) run on. The drain steps
run as it starts (the replica's heartbeat ends there: a replica that admits nothing new should
not be counted in the others' shares of the tenant limits). When the last request ends, or after
``shutdown_grace_seconds``, uvicorn is told to exit; it then closes the connections and runs the
app's shutdown (engine stopped). A second signal exits at once.

Requests still running when the grace ends are cut by the cut steps first (the engine's requests
end with a 503 ``server_shutting_down``, which each API answers in its own error shape: a JSON
error, or an error event in a stream that already started), so that uvicorn does not cancel them
(a text/plain 500 and a logged traceback for each).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Iterator

import uvicorn

from loraplex.server.errors import APIError

log = logging.getLogger("loraplex.server")

# after the grace, how long the requests the cut steps ended get to write their error answers
CUT_ANSWER_SECONDS = 5.0


def grace_ended_error() -> APIError:
    """What a request still running at the end of the shutdown grace is answered."""
    return APIError(503, "The server is shutting down: this request ran past its shutdown grace period.",
                    code="server_shutting_down", headers={"Retry-After": "1"})


class Lifecycle:
    """Process state the routes consult: ready, draining, and the count of admitted requests."""

    def __init__(self) -> None:
        self.started = False  # engine and registry built
        self.draining = False
        self.in_flight = 0
        self._idle: asyncio.Event | None = None
        self._drain_steps: list[Callable[[], Awaitable[None]]] = []
        self._cut_steps: list[Callable[[], Awaitable[int]]] = []

    def add_drain_step(self, step: Callable[[], Awaitable[None]]) -> None:
        """``step()`` is awaited once a drain starts, before it waits for the admitted requests
        (an error is logged, and the drain goes on)."""
        self._drain_steps.append(step)

    def add_cut_step(self, step: Callable[[], Awaitable[int]]) -> None:
        """``step()`` is awaited when a drain's grace ends with requests still in flight: it ends
        the requests it knows of with an answer (returning how many), before uvicorn closes the
        connections."""
        self._cut_steps.append(step)

    def _idle_event(self) -> asyncio.Event:
        if self._idle is None:
            self._idle = asyncio.Event()
            if self.in_flight == 0:
                self._idle.set()
        return self._idle

    def admit(self) -> None:
        """Count one generation request in; 503 once draining."""
        if self.draining:
            raise APIError(503, "The server is shutting down.", code="server_shutting_down", headers={"Retry-After": "1"})
        self.in_flight += 1
        self._idle_event().clear()

    @contextlib.contextmanager
    def admitted(self) -> Iterator[None]:
        """``admit`` ... ``done`` around a block that is no generation but must finish before a
        drain ends (an adapter upload: cut after a second, its client got a 500)."""
        self.admit()
        try:
            yield
        finally:
            self.done()

    def done(self) -> None:
        self.in_flight -= 1
        if self.in_flight <= 0:
            self.in_flight = 0
            self._idle_event().set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no admitted request is left (each has closed), at most ``timeout`` s."""
        if self._idle_event().is_set():  # without a turn of the loop: a timeout of 0 still says so
            return True
        try:
            await asyncio.wait_for(self._idle_event().wait(), timeout=timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def drain(self, grace_seconds: float) -> bool:
        """Stop admitting and wait for admitted requests; True when all finished in time."""
        self.draining = True
        start = time.monotonic()
        for step in self._drain_steps:
            try:
                await step()
            except Exception:  # noqa: BLE001 - the requests still get their grace
                log.exception("drain: a step failed; draining on")
        # the grace counts from the signal: the steps' time comes out of it
        ok = await self.wait_idle(max(0.0, grace_seconds - (time.monotonic() - start)))
        log.info(
            "drain %s after %.2fs (%d requests still in flight)",
            "complete" if ok else "timed out", time.monotonic() - start, self.in_flight,
        )
        return ok

    async def cut(self, answer_seconds: float = CUT_ANSWER_SECONDS) -> bool:
        """Run the cut steps, then wait up to ``answer_seconds`` for the requests they ended to
        close; True when none is left."""
        ended = 0
        for step in self._cut_steps:
            try:
                ended += await step()
            except Exception:  # noqa: BLE001 - uvicorn still cuts what is left
                log.exception("drain: a cut step failed")
        ok = await self.wait_idle(answer_seconds)
        log.info("drain: %d request(s) still running at the end of the grace ended with a 503%s", ended,
                 "" if ok else f"; {self.in_flight} still open are cut by the server")
        return ok


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with a first SIGTERM/SIGINT that drains before exiting (exit status 0)."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, grace_seconds: float):
        super().__init__(config)
        self.lifecycle = lifecycle
        self.grace_seconds = grace_seconds
        self._drain_task: asyncio.Future | bool | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self._drain_task is not None or self._loop is None or sig not in (signal.SIGTERM, signal.SIGINT):
            # second signal: stop now
            self.should_exit = True
            self.force_exit = self._drain_task is not None
            return
        log.info("signal %s: draining (grace %.1fs)", signal.Signals(sig).name, self.grace_seconds)

        async def drain_then_exit() -> None:
            if not await self.lifecycle.drain(self.grace_seconds):
                await self.lifecycle.cut()
            self.should_exit = True

        def start() -> None:
            self._drain_task = asyncio.ensure_future(drain_then_exit())

        # the handler may run at any bytecode boundary of the loop's thread: schedule, do not run
        self._drain_task = True  # marks "draining" for a second signal
        self._loop.call_soon_threadsafe(start)
