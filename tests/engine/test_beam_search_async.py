"""Beam search over the async engine (what the server runs) beside other traffic: its step
requests batch with a plain request and with a second search on an adapter, and every result
is still exactly its reference; cancelling a search mid-way ends it there (its step in flight is
aborted), frees every KV block and leaves the other requests to finish exactly."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex import LLM, BeamSearchParams, SamplingParams
from loraplex.engine.async_engine import AsyncLLMEngine
from loraplex.engine.beam_search_async import beam_search_outputs
from tests.engine.beam_reference import make_eos_prone_model_dir, naive_vllm_beam_search

PROMPT = list(range(10, 180, 10))
OTHER = [7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for

    root = tmp_path_factory.mktemp("beam-async")
    model_dir = make_eos_prone_model_dir(root / "model")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    adapter = make_peft_adapter(hf, root / "a", seed=7)
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=root / "home", block_size=16,
              max_num_seqs=16, max_num_batched_tokens=128)
    engine = AsyncLLMEngine(llm.config, engine=llm.engine)
    yield engine, llm.engine, hf, peft_model_for(hf, {"a": adapter}), str(adapter)
    engine.shutdown()


def _search(engine, core, prompt, params, request_id, adapter=None):
    return beam_search_outputs(engine, prompt, params, request_id=request_id, adapter=adapter,
                               eos_token_ids=core.scheduler.eos_token_ids, tokenizer=core.tokenizer,
                               vocab_size=core.vocab_size, max_model_len=core.max_model_len)


async def _final(gen):
    last = None
    async for out in gen:
        last = out
    return last


async def _tokens(gen) -> list[int]:
    """A plain request's tokens (``generate`` yields deltas)."""
    tokens: list[int] = []
    async for out in gen:
        tokens += out.outputs[0].token_ids if out.outputs else []
    return tokens


def _greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=2)
    return out[0, len(prompt):].tolist()


def test_searches_batch_with_other_requests_and_stay_exact(world):
    engine, core, hf, peft, adapter = world
    params = BeamSearchParams(beam_width=3, max_tokens=6, include_stop_str_in_output=True)

    async def main():
        plain = _tokens(engine.generate(OTHER, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)))
        return await asyncio.gather(_final(_search(engine, core, PROMPT, params, "base")),
                                    _final(_search(engine, core, PROMPT, params, "lora", adapter)), plain)

    steps = core.stats()["num_steps"]
    base, lora, plain = asyncio.run(main())
    for out, model in ((base, hf), (lora, peft)):
        expected = naive_vllm_beam_search(model, PROMPT, 3, 6)
        assert [c.token_ids for c in out.outputs] == [gen for gen, _, _ in expected]  # EOS kept: asked for
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert [c.finish_reason for c in out.outputs] == ["stop" if eos else "length" for _, _, eos in expected]
        assert [c.text for c in out.outputs] == [core.tokenizer.decode(g[:-1] if eos else g) for g, _, eos in expected]
    assert base.outputs[0].token_ids != lora.outputs[0].token_ids
    assert plain == _greedy(hf, OTHER, 12)
    # 12 decode steps of the plain request and 6 steps of each search: shared steps make far fewer
    assert core.stats()["num_steps"] - steps < 12 + 6 + 6


def test_cancelling_a_search_stops_it_and_frees_everything(world):
    engine, core, hf, _, _ = world
    params = BeamSearchParams(beam_width=4, max_tokens=500, ignore_eos=True)

    async def main():
        search = asyncio.ensure_future(_final(_search(engine, core, PROMPT, params, "long")))
        plain = asyncio.ensure_future(_tokens(engine.generate(OTHER, SamplingParams(temperature=0.0, max_tokens=30,
                                                                                   ignore_eos=True))))
        while core.stats()["num_steps"] < start + 10:
            await asyncio.sleep(0.01)
        search.cancel()
        with pytest.raises(asyncio.CancelledError):
            await search
        return await plain

    start = core.stats()["num_steps"]
    before = core.stats()
    plain = asyncio.run(main())
    assert plain == _greedy(hf, OTHER, 30)
    stats = core.stats()
    assert stats["num_unfinished_requests"] == 0
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    # the search stopped where it was cancelled: far fewer step requests than its 500 steps x 4 beams
    ran = (stats["num_requests_finished"] - before["num_requests_finished"])
    assert ran < 4 * 60


def test_the_search_reports_its_prompt_s_cache_hits_not_its_own_steps(world):
    """Every step after the first finds the prompt's blocks the first step left (the engine's
    counter grows); the search's ``num_cached_tokens`` is the prompt's as it came: 0 for a fresh
    prompt, its whole blocks (the last token computed) when an earlier search left them."""
    engine, core, hf, peft, adapter = world
    prompt = list(range(200, 240))  # 40 tokens: two whole blocks of 16 before the last token
    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    before = core.stats()["prefix_cache_hits"]
    cold = asyncio.run(_final(_search(engine, core, prompt, params, "cold")))
    assert core.stats()["prefix_cache_hits"] > before
    assert cold.num_cached_tokens == 0
    warm = asyncio.run(_final(_search(engine, core, prompt, params, "warm")))
    assert warm.num_cached_tokens == (len(prompt) - 1) // 16 * 16 == 32
