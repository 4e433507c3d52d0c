"""A stream whose client is gone stops writing within a few chunks, even when a step hands it a
burst of chunks at once (n choices finishing together, then the usage chunk and [DONE]).

asyncio learns that a connection is lost from a failed write, and tells the protocol (uvicorn,
which then drops further sends) by a callback on the next turn of the event loop; meanwhile every
write to the lost transport is counted, and from the fifth on asyncio logs "socket.send() raised
exception." (constants.LOG_THRESHOLD_FOR_CONNLOST_WRITES). Found by tests/e2e/test_chaos_e2e.py:
clients closing streams mid-way left a trail of those warnings in the server's log.
"""

from __future__ import annotations

import asyncio

from loraplex.server.streaming import SSEResponse

LOST_WRITES_WARNED_FROM = 5  # asyncio.constants.LOG_THRESHOLD_FOR_CONNLOST_WRITES


class LosingTransport:
    """An ASGI ``send``/``receive`` pair modelled on uvicorn over an asyncio transport: the
    ``fail_at``-th body write finds the connection reset; the protocol hears of it one loop turn
    later (``call_soon``), and from then on sends are dropped and ``receive`` reports the
    disconnect."""

    def __init__(self, fail_at: int):
        self.fail_at = fail_at
        self.body_writes = 0
        self.lost = False
        self.disconnected = asyncio.Event()
        self.writes_after_loss = 0

    async def send(self, message) -> None:
        if self.disconnected.is_set():
            return  # uvicorn: the cycle is disconnected
        if message["type"] != "http.response.body":
            return
        if self.lost:
            self.writes_after_loss += 1
            return
        self.body_writes += 1
        if self.body_writes == self.fail_at:
            self.lost = True
            asyncio.get_running_loop().call_soon(self.disconnected.set)  # connection_lost

    async def receive(self):
        await self.disconnected.wait()
        return {"type": "http.disconnect"}


async def _burst(n: int):
    for i in range(n):  # all ready at once: nothing in here waits
        yield f"data: {i}\n\n".encode()


def test_burst_after_client_gone_stops_before_asyncio_warns():
    async def main():
        transport = LosingTransport(fail_at=2)
        closed = []
        response = SSEResponse(_burst(40), on_close=lambda: closed.append(True))
        await response({"type": "http"}, transport.receive, transport.send)
        return transport, closed

    transport, closed = asyncio.run(main())
    assert transport.lost and closed == [True]
    assert transport.writes_after_loss < LOST_WRITES_WARNED_FROM, transport.writes_after_loss


def test_whole_burst_reaches_a_client_that_stays():
    async def main():
        transport = LosingTransport(fail_at=10**9)
        response = SSEResponse(_burst(40))
        await asyncio.wait_for(response({"type": "http"}, transport.receive, transport.send), 5)
        return transport

    assert asyncio.run(main()).body_writes == 41  # 40 events and the closing empty body
