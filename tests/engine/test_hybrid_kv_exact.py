"""Gemma 2 and Gemma 3, whose windowed and global layers keep their KV in pages of their own layer
groups (kv_layout): the windowed groups give back the pages before their window while the global
ones keep the whole context, and greedy generation still equals transformers' token for token
(float32), with contexts several windows long, chunked prefill (chunks crossing the window and
block edges), prefix-cache hits on a prefix past the window, preemption and multi-LoRA. After
every step each running sequence's tables are checked against the rule (global: every block;
windowed: exactly the blocks the next chunk reads) and a brute-force page recount; every page is
free at the end.

The tiny Gemma 3 has 11 layers, 3 of them global: groups of 3 layers, the last windowed group
padded, so layers share storage tensors at different slots."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex.engine.block_manager import FREED_BLOCK
from loraplex.engine.kv_layout import KVLayout
from loraplex.engine.llm import LLM
from loraplex.model.config import ModelSpec
from loraplex.sampling_params import SamplingParams
from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.lora.test_acceptance import greedy, reference

WINDOW, BLOCK, MAX_TOKENS = 10, 4, 30
S, F = "sliding_attention", "full_attention"
LAYER_TYPES = {"gemma2": [S, F, S, F], "gemma3": [S, S, F, S, S, F, S, S, F, S, S]}


def layout_of(model_dir) -> KVLayout:
    return KVLayout.from_layer_windows(ModelSpec.from_dir(model_dir).layer_windows)


def page_bytes(model_dir) -> int:
    spec = ModelSpec.from_dir(model_dir)
    return 2 * layout_of(model_dir).group_size * spec.num_kv_heads * spec.head_dim * 4 * BLOCK


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def model(request, tmp_path_factory):
    kind = request.param
    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp(kind), kind, seed=11, sliding_window=WINDOW,
                                    num_hidden_layers=len(LAYER_TYPES[kind]), layer_types=LAYER_TYPES[kind])
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(4, 300, (23,), generator=gen).tolist()  # a prefix past the window
    prompts = [torch.randint(4, 300, (n,), generator=gen).tolist() for n in (5, 47)]
    prompts += [shared + torch.randint(4, 300, (n,), generator=gen).tolist() for n in (3, 14, 30)]
    want = [greedy(ref, p, MAX_TOKENS) for p in prompts]
    return model_dir, ref, prompts, want


def _llm(model_dir, home, num_pages: int, **options) -> LLM:
    options = {"block_size": BLOCK, "kv_cache_bytes": num_pages * page_bytes(model_dir),
               "max_num_batched_tokens": 16, "max_num_seqs": 8, **options}
    return LLM(model=str(model_dir), dtype="float32", device="cpu", home=home, **options)


def check_tables(llm: LLM) -> None:
    engine = llm.engine
    bm, windows = engine.block_manager, engine.block_manager.group_windows
    refs = [0] * bm.num_blocks
    for seq in engine.scheduler.running:
        first_block = seq.num_computed_tokens // BLOCK
        for window, table in zip(windows, seq.block_tables):
            first_read = 0 if window is None else max(0, seq.num_computed_tokens - window + 1)
            assert [b != FREED_BLOCK for b in table] == [(i + 1) * BLOCK > first_read for i in range(len(table))]
            assert len(table) >= first_block
            for b in table:
                if b != FREED_BLOCK:
                    refs[b] += 1
    assert [bm.ref_count(b) for b in range(bm.num_blocks)] == refs
    stats = engine.stats()
    assert stats["num_blocks_free"] == sum(1 for r in refs if r == 0)
    assert stats["kv_cache_usage"] == pytest.approx(1 - stats["num_blocks_free"] / stats["num_blocks_total"])


def generate_checked(llm: LLM, prompts, params=None, adapters=None) -> list[list[int]]:
    engine = llm.engine
    params = params or SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [engine.add_request(None, p, params, adapter=a) for p, a in zip(prompts, adapters or [None] * len(prompts))]
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
        check_tables(llm)
    stats = engine.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"]  # nothing leaked
    return [finals[i] for i in ids]


def test_layouts_are_hybrid(model):
    model_dir, *_ = model
    layout = layout_of(model_dir)
    assert layout.is_hybrid and None in layout.group_windows and WINDOW in layout.group_windows
    if len(layout.layer_group) == 11:  # Gemma 3: 3 global layers, 8 windowed in groups of 3
        assert layout.group_size == 3 and layout.group_windows == (None, WINDOW, WINDOW, WINDOW)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_outputs_match_transformers_while_windowed_groups_free_pages(model, loraplex_home, prefix_caching):
    model_dir, _, prompts, want = model
    layout = layout_of(model_dir)
    # enough pages for every sequence's global context and windowed windows, not whole contexts
    whole = sum(layout.num_groups * -(-(len(p) + MAX_TOKENS) // BLOCK) for p in prompts)
    num_pages = 130
    assert num_pages < whole
    llm = _llm(model_dir, loraplex_home, num_pages=num_pages, enable_prefix_caching=prefix_caching)
    assert llm.engine.block_manager.num_blocks == num_pages
    assert llm.engine.block_manager.group_windows == layout.group_windows
    assert generate_checked(llm, prompts) == want
    assert llm.engine.stats()["num_preemptions"] == 0
    if prefix_caching:  # again: the shared prefix and the first run's prompts hit the cache
        assert generate_checked(llm, prompts) == want
        assert llm.engine.stats()["prefix_cache_hits"] >= 3 * 20


def test_chunks_crossing_window_and_block_edges(model, loraplex_home):
    """7 tokens a step: prompt chunks start at every offset to the window and block edges."""
    model_dir, _, prompts, want = model
    llm = _llm(model_dir, loraplex_home, num_pages=130, max_num_batched_tokens=7, enable_prefix_caching=True)
    assert generate_checked(llm, prompts) == want
    assert llm.engine.stats()["num_chunked_prefills"] >= 20


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preempted_sequences_recompute_exactly(model, loraplex_home, prefix_caching):
    model_dir, _, prompts, want = model
    llm = _llm(model_dir, loraplex_home, num_pages=70, max_num_seqs=10, enable_prefix_caching=prefix_caching)
    assert generate_checked(llm, prompts * 2) == want * 2
    assert llm.engine.stats()["num_preemptions"] > 0


def test_multi_lora_batch_matches_peft(model, loraplex_home, tmp_path):
    model_dir, ref, prompts, _ = model
    dirs = {
        "a": make_peft_adapter(ref, tmp_path / "a", seed=21, r=4, target_modules=["q_proj", "k_proj", "v_proj"]),
        "b": make_peft_adapter(ref, tmp_path / "b", seed=22, r=2, target_modules=["o_proj", "down_proj"]),
    }
    peft_model = peft_model_for(ref, dirs)
    which = ["a", None, "b", "a", "b"]
    llm = _llm(model_dir, loraplex_home, num_pages=130, enable_prefix_caching=True, max_loras=2, max_lora_rank=4)
    for name, path in dirs.items():
        llm.engine.register_adapter(name, str(path))
    got = generate_checked(llm, prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), which)
    assert got == [reference(peft_model, p, w, 12) for p, w in zip(prompts, which)]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_speculative_decoding_frees_every_groups_pages(model, loraplex_home, prefix_caching):
    """n-gram drafts on repeating prompts: rejected drafts' pages go back in every group, the
    outputs stay transformers' greedy ones, under preemption."""
    from tests.engine.spec_helpers import NGRAM, assert_drafts_accepted_and_rejected, repeating_prompts

    model_dir, ref, _, _ = model
    prompts = repeating_prompts(count=5, seed=1)[:6]
    want = [greedy(ref, p, 20) for p in prompts]
    llm = _llm(model_dir, loraplex_home, num_pages=60, speculative_config=NGRAM, enable_prefix_caching=prefix_caching)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    assert generate_checked(llm, prompts, params) == want
    assert_drafts_accepted_and_rejected(llm)
    assert llm.engine.stats()["num_preemptions"] > 0
