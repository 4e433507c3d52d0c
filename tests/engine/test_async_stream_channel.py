"""``AsyncLLMEngine``'s per-request channel (``_Stream``: a deque and the reader's wake-up
future) against ``asyncio.Queue``, which it replaced: the same items in the same order for any
interleaving of pushes (one or several per loop turn, from the loop or another thread) and reads,
a reader cancelled while waiting loses nothing, and a put to a closed loop says so."""

from __future__ import annotations

import asyncio
import random
import threading

from loraplex.engine.async_engine import _Stream


async def _drive(rng: random.Random, make_put, get, cancel_some: bool) -> list:
    """Pushes 0..n-1 in bursts between loop turns; one reader reads them all (restarted when
    cancelled); returns what it read in order."""
    n = 300
    got: list = []

    async def reader() -> None:
        while len(got) < n:
            got.append(await get())

    task = asyncio.ensure_future(reader())
    i = 0
    while i < n:
        for _ in range(rng.randrange(0, 5)):
            if i < n:
                make_put(i)
                i += 1
        for _ in range(rng.randrange(0, 3)):
            await asyncio.sleep(0)
        if cancel_some and rng.random() < 0.1 and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            task = asyncio.ensure_future(reader())
    await asyncio.wait_for(task, 5)
    return got


def test_same_order_as_an_asyncio_queue_under_random_interleavings():
    for seed in range(20):
        for cancel_some in (False, True):
            async def with_stream():
                stream = _Stream(asyncio.get_running_loop())
                return await _drive(random.Random(seed), stream.push, stream.get, cancel_some)

            async def with_queue():
                queue: asyncio.Queue = asyncio.Queue()
                return await _drive(random.Random(seed), queue.put_nowait, queue.get, cancel_some)

            assert asyncio.run(with_stream()) == asyncio.run(with_queue()) == list(range(300))


def test_puts_from_another_thread_arrive_in_order():
    async def main():
        stream = _Stream(asyncio.get_running_loop())

        def producer():
            for i in range(2000):
                assert stream.put(i)

        thread = threading.Thread(target=producer)
        thread.start()
        got = [await asyncio.wait_for(stream.get(), 5) for _ in range(2000)]
        thread.join()
        return got

    assert asyncio.run(main()) == list(range(2000))


def test_put_to_a_closed_loop_returns_false():
    loop = asyncio.new_event_loop()
    stream = _Stream(loop)
    loop.close()
    assert stream.put(1) is False
