"""What the server's lifespan started, stopped last-started first: at shutdown, and when a later
start step fails. Without the second, a start that failed part-way (a bad setting found once
the engine is built, ``on_started`` raising) left the engine, the background threads and this
replica's heartbeat row behind while the process went on to exit with the error.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("loraplex.server")


class ShutdownSteps:
    """Stop steps, each added once its part has started; ``run`` calls them last-added first,
    every one even when one before it failed, and returns the errors (each step at most once)."""

    def __init__(self) -> None:
        self._steps: list[tuple[str, Callable[[], Awaitable[None]]]] = []

    def add(self, name: str, stop: Callable[[], Awaitable[None]]) -> None:
        self._steps.append((name, stop))

    @property
    def names(self) -> list[str]:
        """The steps ``run`` would take, in its order."""
        return [name for name, _ in reversed(self._steps)]

    async def run(self) -> list[tuple[str, Exception]]:
        """Stop everything added, last-added first; (name, error) of each step that raised."""
        errors = []
        while self._steps:
            name, stop = self._steps.pop()
            try:
                await stop()
            except Exception as exc:  # noqa: BLE001 - the remaining parts are stopped all the same
                errors.append((name, exc))
        return errors

    async def run_after_failed_start(self) -> None:
        """``run``, for a start that raised: the errors stopping are logged, never raised, so
        that the start's own error is the one the process exits with."""
        if self._steps:
            log.error("startup failed; stopping what had started: %s", ", ".join(self.names))
        for name, exc in await self.run():
            log.error("stopping %s after the failed start failed too", name, exc_info=exc)
