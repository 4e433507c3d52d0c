"""Beam search over the async engine (the server's ``"use_beam_search": true``), vLLM's online
form: each step submits one one-token request per live beam through ``AsyncLLMEngine.generate``,
so the steps batch with every other request the engine runs, carry the request's adapter,
tenant and priority, and find the shared prefix in the prefix cache. The search is
loraplex/beam_search.py.

Cancelling the consumer (a client gone) or closing the generator cancels the step in flight:
each of its requests is aborted by ``generate`` itself, so no KV block outlives the search.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from loraplex.beam_search import BeamSearch, BeamSearchParams, returned_text_ids, returned_token_ids
from loraplex.engine.outputs import CompletionOutput, RequestOutput


async def _collect(gen) -> tuple[list[dict], str | None, int | None]:
    """Drain one step request: its logprobs entries, its finish reason and its prefix-cache hits."""
    logprobs: list[dict] = []
    finish = cached = None
    try:
        async for out in gen:
            cached = out.num_cached_tokens
            for comp in out.outputs:
                logprobs.extend(comp.logprobs or [])
                finish = comp.finish_reason or finish
    finally:
        await gen.aclose()
    return logprobs, finish, cached


async def beam_search_outputs(engine, prompt_ids: list[int], params: BeamSearchParams, *, request_id: str,
                              eos_token_ids, tokenizer, vocab_size: int, max_model_len: int, adapter=None,
                              cache_salt: str | None = None, priority: int = 0, tenant: str | None = None,
                              tenant_weight: float = 1.0) -> AsyncIterator[RequestOutput]:
    """Yields one finished ``RequestOutput`` whose ``outputs`` are the ``beam_width`` best beams,
    best first (``index`` 0..n-1): ``token_ids`` without the finishing EOS unless
    ``include_stop_str_in_output``, ``text`` never with it, ``finish_reason`` "stop" (an EOS) or
    "length" (vLLM's online output). A step request aborted from outside ends the search with
    ``finish_reason == "abort"``. ``num_cached_tokens`` is the first step's (the prompt as it
    came): later steps find the search's own blocks, which is no cache hit of the request."""
    search = BeamSearch.in_context(prompt_ids, params, eos_token_ids, max_model_len, vocab_size)
    step = 0
    cached = None
    while not search.done:
        tasks = [
            asyncio.ensure_future(_collect(engine.generate(
                tokens, search.step_sampling, request_id=f"{request_id}-beam{step}.{i}", adapter=adapter,
                cache_salt=cache_salt, priority=priority, tenant=tenant, tenant_weight=tenant_weight)))
            for i, tokens in enumerate(search.step_prompts())
        ]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:  # cancelled, closed, or one step refused: stop every other one
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        if step == 0 and results:
            cached = results[0][2]
        if any(finish == "abort" for _, finish, _ in results):
            yield RequestOutput(request_id, None, list(prompt_ids),
                                [CompletionOutput(0, "", [], "abort")], finished=True, num_cached_tokens=cached)
            return
        search.advance_from_outputs([logprobs for logprobs, _, _ in results])
        step += 1
    outputs = [
        CompletionOutput(
            index=i,
            text=tokenizer.decode(returned_text_ids(beam)),
            token_ids=returned_token_ids(beam, params.include_stop_str_in_output),
            finish_reason=beam.finish_reason,
            stop_reason=beam.stop_reason,
        )
        for i, beam in enumerate(search.best())
    ]
    yield RequestOutput(request_id, None, list(prompt_ids), outputs, finished=True, num_cached_tokens=cached)
