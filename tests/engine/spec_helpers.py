"""Shared by the speculative-decoding tests: prompts that repeat, and engines with speculation on
or off over the same tiny model."""

from __future__ import annotations

import torch

from loraplex.engine.llm import LLM

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def repeating_prompts(count: int = 8, seed: int = 0) -> list[list[int]]:
    """Prompts made of a random segment repeated (so drafts are found from the first decode),
    plus a few plain random ones (drafts come from the output's own loops, if any)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        segment = torch.randint(4, 300, (5 + 3 * i,), generator=gen).tolist()
        prompts.append(segment * 3 + segment[: 2 + i % 3])
    prompts += [torch.randint(4, 300, (9 + 7 * i,), generator=gen).tolist() for i in range(3)]
    return prompts


def make_llm(model_dir, home, spec: bool, **options) -> LLM:
    options = {"dtype": "float32", "device": "cpu", "home": home, **options}
    return LLM(model=str(model_dir), speculative_config=NGRAM if spec else None, **options)


def assert_blocks_all_free(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"], stats
    bm = llm.engine.block_manager
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))


def assert_drafts_accepted_and_rejected(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0, stats
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], stats
