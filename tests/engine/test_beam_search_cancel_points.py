"""A beam search over the async engine cancelled at every await point of its first steps (before
its first step request is in, while a step's requests are queued, mid-step, between steps), on
the base model and on an adapter: each cancellation leaves no engine request, no KV block and no
adapter reference behind (the engine's own counters, polled until the aborts are applied)."""

from __future__ import annotations

import asyncio

import pytest

from loraplex import BeamSearchParams
from tests.engine.test_beam_search_async import PROMPT, _final, _search, world  # noqa: F401

# event-loop turns before the cancel: every turn of the first steps, then a sparser sweep
CANCEL_AFTER = list(range(40)) + list(range(40, 400, 7))


def _idle(core) -> bool:
    s = core.stats()
    return s["num_unfinished_requests"] == 0 and s["num_blocks_free"] == s["num_blocks_total"]


@pytest.mark.parametrize("on_adapter", [False, True])
def test_a_search_cancelled_anywhere_leaves_nothing_behind(world, on_adapter):
    engine, core, _, _, adapter = world
    params = BeamSearchParams(beam_width=3, max_tokens=4)
    leaks, finished = [], 0

    async def main():
        nonlocal finished
        for turns in CANCEL_AFTER:
            task = asyncio.ensure_future(_final(_search(engine, core, PROMPT, params, f"cancel{turns}-{on_adapter}",
                                                        adapter if on_adapter else None)))
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            try:
                await task
                finished += 1  # the search ended before the cancel came
            except asyncio.CancelledError:
                pass
            for _ in range(400):
                if _idle(core):
                    break
                await asyncio.sleep(0.005)
            else:
                stats = core.stats()
                leaks.append((turns, stats["num_unfinished_requests"], stats["num_blocks_free"]))

    asyncio.run(main())
    assert not leaks, leaks
    assert finished < len(CANCEL_AFTER)  # the cancels did land mid-search
    adapters = core.lora_manager.stats()["adapters"]
    assert all(a["outstanding_requests"] == 0 for a in adapters.values()), adapters
