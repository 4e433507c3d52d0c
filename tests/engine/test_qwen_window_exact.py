"""Qwen2 / Qwen3 with ``use_sliding_window``: the layers from ``max_window_layers`` on attend
within the window, the ones below to the whole context, as in transformers. The engine keeps the
two kinds in layer groups of their own (kv_layout), the windowed ones giving pages back, and
greedy tokens equal transformers' (float32) through a pool too small for whole contexts, with
chunks crossing the window and block edges, prefix-cache hits past the window and preemption;
every group's table is checked each step (test_hybrid_kv_exact.check_tables)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex.model.config import ModelSpec
from loraplex.sampling_params import SamplingParams
from tests.engine.test_hybrid_kv_exact import BLOCK, _llm, generate_checked, layout_of
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.lora.test_acceptance import greedy

WINDOW, MAX_TOKENS = 7, 24
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# (kind, layers, max_window_layers): Qwen2 with 2 global layers and 3 windowed (groups of one
# layer), Qwen3 half and half (groups of two), and a Qwen2 windowed everywhere (one group)
CASES = [("qwen2", 5, 2), ("qwen3", 4, 2), ("qwen2", 3, 0)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{k}-{n}-{m}" for k, n, m in CASES])
def model(request, tmp_path_factory):
    kind, layers, first_windowed = request.param
    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp(kind), kind, seed=7, num_hidden_layers=layers,
                                    use_sliding_window=True, sliding_window=WINDOW,
                                    max_window_layers=first_windowed)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    assert [t == "sliding_attention" for t in ref.config.layer_types] == [i >= first_windowed for i in range(layers)]
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(4, 300, (13,), generator=gen).tolist()  # past the window
    prompts = [torch.randint(4, 300, (n,), generator=gen).tolist() for n in (3, 29)]
    prompts += [shared + torch.randint(4, 300, (n,), generator=gen).tolist() for n in (2, 9, 18)]
    want = [greedy(ref, p, MAX_TOKENS) for p in prompts]
    return model_dir, prompts, want, layers, first_windowed


def test_layer_groups_follow_max_window_layers(model):
    model_dir, _, _, layers, first_windowed = model
    windows = [None] * first_windowed + [WINDOW] * (layers - first_windowed)
    assert list(ModelSpec.from_dir(model_dir).layer_windows) == windows
    layout = layout_of(model_dir)
    assert [layout.group_windows[g] for g in layout.layer_group] == windows


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_outputs_match_transformers(model, loraplex_home, prefix_caching):
    model_dir, prompts, want, *_ = model
    llm = _llm(model_dir, loraplex_home, num_pages=90, max_num_batched_tokens=6,
               enable_prefix_caching=prefix_caching)
    assert generate_checked(llm, prompts, PARAMS) == want
    if prefix_caching:  # again: every prompt's leading blocks are cached now
        assert generate_checked(llm, prompts, PARAMS) == want
        assert llm.engine.stats()["prefix_cache_hits"] >= 40


def test_preempted_sequences_recompute_exactly(model, loraplex_home):
    model_dir, prompts, want, *_ = model
    # a few pages more than the longest sequence's peak: ten sequences must take turns
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    num_pages = layout_of(model_dir).peak_pages_per_sequence(longest, BLOCK, 16) + 3
    llm = _llm(model_dir, loraplex_home, num_pages=num_pages, max_num_seqs=10, enable_prefix_caching=True)
    assert generate_checked(llm, prompts * 2, PARAMS) == want * 2
    assert llm.engine.stats()["num_preemptions"] > 0
