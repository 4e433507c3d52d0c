"""A fake engine that emits scripted text: each request takes the next script, a list of text
pieces, one engine delta per piece (every choice the same), and finishes with "stop" after the
last piece, or "length" when ``max_tokens`` cuts it first. For testing what the server reads out
of a model's text (tool calls, reasoning) without a model."""

from __future__ import annotations

import asyncio

from loraplex.engine.outputs import CompletionOutput, RequestOutput
from tests.server.fakes import VOCAB_OFFSET, FakeEngine


class ScriptedEngine(FakeEngine):
    """``scripts``: the pieces of each coming request, in order (``push`` adds more)."""

    def __init__(self, *scripts: list[str], **kwargs):
        super().__init__(**kwargs)
        self.scripts: list[list[str]] = list(scripts)
        self.prompts: list[list[int]] = []

    def push(self, *pieces: str) -> None:
        self.scripts.append(list(pieces))

    async def generate(self, prompt, params, request_id=None, adapter=None, cache_salt=None, priority=0,
                       tenant=None, tenant_weight=1.0):
        pieces = self.scripts.pop(0)
        with self._lock:
            self.started.append((request_id, None))
            self.params_seen[request_id] = params
            self.prompts.append(list(prompt))
            self.blocks_in_use[request_id] = 1
        try:
            for k, piece in enumerate(pieces[:params.max_tokens]):
                await asyncio.sleep(self.step_seconds)
                if request_id in self.aborted:
                    return
                last = k == len(pieces) - 1 or k == params.max_tokens - 1
                finish = None if not last else ("stop" if k == len(pieces) - 1 else "length")
                outs = [CompletionOutput(c, piece, [VOCAB_OFFSET], finish, None, None) for c in range(params.n)]
                yield RequestOutput(request_id, None, list(prompt), outs, last, None)
        finally:
            with self._lock:
                self.blocks_in_use.pop(request_id, None)
