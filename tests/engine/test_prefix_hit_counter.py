"""The global prefix-cache counters (``prefix_cache_queries`` / ``prefix_cache_hits`` in the
engine stats and ``vllm:prefix_cache_*`` on /metrics) count each sequence's lookup once, at its
first admission, as vLLM does since vllm-project/vllm#25787: a preempted sequence re-admitted
finds much of its own recomputed context cached, and counting that made the hit rate grow with
memory pressure instead of with shared prompts. The expected numbers are worked out here from the
block size and the prompts, not read from the engine."""

from __future__ import annotations

import torch

from loraplex import SamplingParams
from loraplex.engine.block_manager import BlockManager
from tests.engine.scheduler_harness import Harness, reference_output
from tests.engine.test_engine_exact import PROMPT_LENGTHS, tight_llm

BLOCK = 4


def count_every_allocation(monkeypatch) -> list[int]:
    """The hits of every ``allocate`` (first admissions and re-admissions alike): what the old
    counter added up, so the test shows the scenario does re-admit onto cached blocks."""
    hits: list[int] = []
    real = BlockManager.allocate

    def allocate(self, seq, num_new_tokens):
        real(self, seq, num_new_tokens)
        hits.append(seq.num_computed_tokens)

    monkeypatch.setattr(BlockManager, "allocate", allocate)
    return hits


def test_re_admissions_after_preemption_count_no_hits_or_queries(monkeypatch):
    # four prompts of two shared blocks and two own tokens, admitted together: the first computes
    # the shared blocks and the other three take them in the same step. Then their decodes grow
    # past the 10 blocks, so sequences are preempted and re-admitted onto their own cached blocks.
    all_hits = count_every_allocation(monkeypatch)
    shared = [7, 8, 9, 10, 11, 12, 13, 14]  # two whole blocks
    prompts = [shared + [20 + i, 30 + i] for i in range(4)]
    h = Harness(num_blocks=10, block_size=BLOCK, enable_prefix_caching=True, max_num_batched_tokens=64)
    seqs = [h.add(p, max_tokens=12) for p in prompts]
    h.run()
    stats = h.scheduler.stats
    assert stats.num_preemptions > 0
    assert len(all_hits) > len(prompts) and sum(all_hits) > 3 * len(shared)  # re-admissions did hit
    assert stats.num_prefix_query_tokens == sum(len(p) for p in prompts)
    assert stats.num_prefix_hit_tokens == 3 * len(shared)
    assert [s.num_cached_tokens for s in seqs] == [0] + [len(shared)] * 3
    for seq, prompt in zip(seqs, prompts):
        assert seq.output_token_ids == reference_output(prompt, 12)
    assert h.block_manager.num_free_blocks == h.block_manager.num_blocks


def test_an_admission_whose_step_never_ran_is_taken_back():
    h = Harness(num_blocks=64, block_size=BLOCK, enable_prefix_caching=True, max_num_batched_tokens=64)
    prompt = list(range(30, 39))  # 9 tokens: two full blocks
    h.add(prompt, max_tokens=2)
    h.add(prompt + [60], max_tokens=2)
    out = h.scheduler.schedule()
    stats = h.scheduler.stats
    assert (stats.num_prefix_query_tokens, stats.num_prefix_hit_tokens) == (9 + 10, 2 * BLOCK)
    h.scheduler.requeue_unrun(out)  # the step failed before it ran: neither admission happened
    assert (stats.num_prefix_query_tokens, stats.num_prefix_hit_tokens) == (0, 0)
    h.run()  # admitted again, in one step: the second shares the first's blocks again
    assert (stats.num_prefix_query_tokens, stats.num_prefix_hit_tokens) == (9 + 10, 2 * BLOCK)


def test_without_prefix_caching_nothing_is_counted():
    h = Harness(num_blocks=64, block_size=BLOCK, enable_prefix_caching=False, max_num_batched_tokens=64)
    h.add(list(range(10, 22)), max_tokens=2)
    h.add(list(range(10, 22)), max_tokens=2)
    h.run()
    assert (h.scheduler.stats.num_prefix_query_tokens, h.scheduler.stats.num_prefix_hit_tokens) == (0, 0)


def test_a_sequence_that_skips_the_lookup_is_no_query():
    """Prompt logprobs need the whole prompt computed, so such a sequence never reads the prefix
    cache; vLLM counts no query for it (``record_prefix_cache_stats``: "Don't count a request that
    skipped the cache lookup"), else every such request lowered the hit rate as a full miss. Its
    blocks are still written: a later sequence hits them."""
    h = Harness(num_blocks=64, block_size=BLOCK, enable_prefix_caching=True, max_num_batched_tokens=64)
    prompt = list(range(40, 49))  # 9 tokens: two full blocks
    first = h.add(prompt, max_tokens=2)
    h.run()
    stats = h.scheduler.stats
    assert (stats.num_prefix_query_tokens, stats.num_prefix_hit_tokens) == (9, 0)
    scoring = h.add(prompt, max_tokens=2, prompt_logprobs=0)
    h.run()
    assert scoring.num_cached_tokens == 0  # computed whole, though its blocks were cached
    assert (stats.num_prefix_query_tokens, stats.num_prefix_hit_tokens) == (9, 0)
    later = h.add(prompt + [70], max_tokens=2)
    h.run()
    assert later.num_cached_tokens == 2 * BLOCK
    assert (stats.num_prefix_query_tokens, stats.num_prefix_hit_tokens) == (9 + 10, 2 * BLOCK)
    # the first token of each run is the fake model's: the scoring one ran as the others did
    assert first.output_token_ids == scoring.output_token_ids == reference_output(prompt, 2)


def test_engine_stats_leave_out_prompt_logprobs_requests(tiny_llama_dir, loraplex_home):
    llm = tight_llm(tiny_llama_dir, loraplex_home, enable_prefix_caching=True)
    prompt = torch.randint(4, 300, (50,), generator=torch.Generator().manual_seed(5)).tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([{"prompt_token_ids": prompt}], greedy)
    [scored] = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1,
                                                                          prompt_logprobs=1))
    assert scored.num_cached_tokens == 0 and len(scored.prompt_logprobs) == 50
    stats = llm.engine.stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (50, 0)
    llm.generate([{"prompt_token_ids": prompt}], greedy)
    stats = llm.engine.stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (100, (50 - 1) // 16 * 16)


def test_engine_stats_count_first_admissions_only(tiny_llama_dir, loraplex_home, monkeypatch):
    """A real tiny engine that preempts and chunks: distinct prompts share no block, so the hits
    are 0 and the queries the prompts' tokens, however often sequences were re-admitted; then a new
    prompt sent twice hits its whole blocks once."""
    all_hits = count_every_allocation(monkeypatch)
    llm = tight_llm(tiny_llama_dir, loraplex_home, enable_prefix_caching=True)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 300, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and sum(all_hits) > 0, stats  # re-admissions found blocks
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (sum(PROMPT_LENGTHS), 0)
    fresh = torch.randint(4, 300, (50,), generator=gen).tolist()
    for _ in range(2):  # nothing else runs: its blocks stay cached for the second time
        llm.generate([{"prompt_token_ids": fresh}], SamplingParams(temperature=0.0, max_tokens=1))
    stats = llm.engine.stats()
    assert stats["prefix_cache_queries"] == sum(PROMPT_LENGTHS) + 2 * 50
    assert stats["prefix_cache_hits"] == (50 - 1) // 16 * 16  # the second time: its three whole blocks
