"""``LLM.beam_search``: vLLM's offline beam search over the synchronous engine.

Each step gathers one one-token request per live beam of every prompt in the batch and runs
them together (so the beams of all prompts share each engine step); the shared prefixes come
back from the prefix cache. The search itself is loraplex/beam_search.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loraplex.beam_search import (
    BeamSearch, BeamSearchOutput, BeamSearchParams, check_beam_width_cap, step_sampling_params,
)
from loraplex.sampling_params import InvalidRequestError

if TYPE_CHECKING:  # pragma: no cover
    from loraplex.engine.llm import LLM


def run_offline_beam_search(llm: "LLM", prompts, params: BeamSearchParams, lora_request=None,
                            concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
    from loraplex.engine.llm import _adapters_of, _normalize_prompts

    if not isinstance(params, BeamSearchParams):
        raise InvalidRequestError("params must be a BeamSearchParams", param="params")
    params.validate()
    if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
        raise InvalidRequestError("concurrency_limit must be a positive integer or None", param="concurrency_limit")
    engine = llm._idle_engine()
    items = _normalize_prompts(prompts)
    adapters = [None] * len(items) if lora_request is None else _adapters_of(lora_request, len(items))
    if len(adapters) != len(items):
        raise InvalidRequestError("lora_request must be one LoRARequest or one per prompt", param="lora_request")
    check_beam_width_cap(params.beam_width, engine.config.max_logprobs, engine.vocab_size)

    eos = engine.scheduler.eos_token_ids
    searches, salts, adapter_ids = [], [], []
    for (prompt, salt), adapter in zip(items, adapters):
        # validates and tokenizes the prompt as generate does; nothing is queued
        probe = engine.prepare_request(None, prompt, step_sampling_params(params, engine.vocab_size), cache_salt=salt)
        ids = probe.prompt_token_ids
        searches.append(BeamSearch.in_context(ids, params, eos, engine.max_model_len, engine.vocab_size))
        salts.append(salt)
        adapter_ids.append(engine.resolve_adapter(adapter))

    limit = concurrency_limit or max(1, len(searches))
    for start in range(0, len(searches), limit):
        batch = range(start, min(start + limit, len(searches)))
        while any(not searches[i].done for i in batch):
            _one_step(llm, [(searches[i], salts[i], adapter_ids[i]) for i in batch if not searches[i].done])

    tok = engine.tokenizer
    outputs = []
    for search in searches:
        best = search.best()
        for beam in best:
            beam.text = tok.decode(beam.tokens)  # vLLM's offline text: prompt and output
        outputs.append(BeamSearchOutput(sequences=best))
    return outputs


def _one_step(llm: "LLM", work: list[tuple[BeamSearch, str | None, str | None]]) -> None:
    """One token for every live beam of every search in ``work``, in one engine run."""
    engine = llm.engine
    prepared, owners = [], []
    for search, salt, adapter_id in work:
        reqs = []
        for tokens in search.step_prompts():
            req = engine.prepare_request(None, tokens, search.step_sampling, cache_salt=salt)
            req.adapter_id = adapter_id
            req.final_only = True
            reqs.append(req)
        prepared.extend(reqs)
        owners.append((search, reqs))
    finals = llm._run_prepared(prepared)
    for search, reqs in owners:
        search.advance_from_outputs([finals[r.request_id].outputs[0].logprobs for r in reqs])
