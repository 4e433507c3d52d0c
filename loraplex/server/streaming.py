"""Server-sent events, and noticing a client that went away.

Both the SSE response and ``run_unless_disconnected`` listen on the ASGI ``receive`` channel for
``http.disconnect`` while the work runs, and cancel the work the moment it arrives. Cancelling
closes the engine's async generator, whose cleanup aborts the engine request, so a client that
hangs up stops costing KV blocks within one event-loop turn, not at the next token write.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from loraplex.server.json_encoding import compact_json

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"
# A step can hand a stream a burst of ready chunks (n choices finishing, usage, [DONE]) that is
# written without the event loop turning. A write that finds the client gone is reported to the
# server (which then drops sends) only on the next turn, and asyncio logs "socket.send() raised
# exception." from the fifth write to a lost connection: so yield to the loop every few chunks.
YIELD_EVERY_CHUNKS = 4


def sse_event(obj: dict) -> bytes:
    return b"data: " + compact_json(obj).encode("utf-8") + b"\n\n"


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse:
    """An ASGI response streaming ``events`` (already-encoded SSE bytes).

    ``on_close`` runs once whatever happens (finished, disconnected, failed): the place to give
    back per-request resources.
    """

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None, on_close=None):
        self.events = events
        self.on_close = on_close
        self.headers = {"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
            raw_headers += [(k.encode(), v.encode()) for k, v in self.headers.items()]
            await send({"type": "http.response.start", "status": 200, "headers": raw_headers})
            sent = 0
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                sent += 1
                if sent % YIELD_EVERY_CHUNKS == 0:
                    await asyncio.sleep(0)
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        pump_task = asyncio.ensure_future(pump())
        watch_task = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({pump_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump_task, watch_task):
                if not task.done():
                    task.cancel()
            await asyncio.gather(pump_task, watch_task, return_exceptions=True)
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
            if self.on_close is not None:  # also when the stream never started
                self.on_close()
        if pump_task.done() and not pump_task.cancelled() and pump_task.exception() is not None:
            exc = pump_task.exception()
            if not isinstance(exc, OSError):  # a write to a closed socket is a disconnect
                raise exc


async def run_unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientDisconnected.

    The request body must already have been read (the receive channel then only carries the
    disconnect).
    """
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work_task, watch_task):
            if not task.done():
                task.cancel()
        await asyncio.gather(work_task, watch_task, return_exceptions=True)
    if work_task.cancelled():
        raise ClientDisconnected()
    return work_task.result()
