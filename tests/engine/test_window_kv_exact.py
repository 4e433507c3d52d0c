"""A sliding-window model frees the KV blocks that slid out of its window, and still generates
exactly what transformers does: a tiny random-weight Mistral with a 12-token window over 8-token
blocks (not a whole number of blocks), 60 greedy tokens on prompts up to 70 tokens, against
``MistralForCausalLM`` (eager attention, which applies the window) on the same weights; with
prefix caching on and off, chunks that cross the window's edge, and preemption. The blocks held
stay bounded (engine stats), and every block is free when all requests are done."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex.engine.llm import LLM
from loraplex.model.config import ModelSpec
from loraplex.sampling_params import SamplingParams
from tests.engine.test_engine_exact import kv_bytes_per_token
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.lora.test_acceptance import greedy

WINDOW, BLOCK, MAX_TOKENS = 12, 8, 60
# blocks a running sequence holds between steps: those with keys of its next token's window
WINDOW_BLOCKS = -(-(WINDOW - 1) // BLOCK) + 1


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("mistral-swa"), "mistral", seed=8, sliding_window=WINDOW)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    assert ref.config.sliding_window == WINDOW
    gen = torch.Generator().manual_seed(9)
    shared = torch.randint(4, 300, (29,), generator=gen).tolist()  # a prefix past the window
    prompts = [torch.randint(4, 300, (n,), generator=gen).tolist() for n in (5, 70)]
    prompts += [shared + torch.randint(4, 300, (n,), generator=gen).tolist() for n in (3, 17, 40)]
    want = [greedy(ref, p, MAX_TOKENS) for p in prompts]
    return model_dir, prompts, want


def _llm(model_dir, home, num_blocks: int, **options) -> LLM:
    options = {"block_size": BLOCK, "kv_cache_bytes": num_blocks * BLOCK * kv_bytes_per_token(model_dir),
               "max_num_batched_tokens": 64, "max_num_seqs": 8, **options}
    return LLM(model=str(model_dir), dtype="float32", device="cpu", home=home, **options)


def _generate_checked(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Step the engine, checking after every step that the blocks in use are at most the running
    sequences' windows (shared prefix blocks count once, so this is an upper bound)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts]
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
        stats = engine.stats()
        in_use = stats["num_blocks_total"] - stats["num_blocks_free"]
        assert in_use <= stats["num_seqs_running"] * WINDOW_BLOCKS
        assert stats["kv_cache_usage"] == pytest.approx(in_use / stats["num_blocks_total"])
    stats = engine.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"]  # nothing leaked
    return [finals[i] for i in ids]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_outputs_match_transformers_while_blocks_slide_out(mistral, loraplex_home, prefix_caching):
    model_dir, prompts, want = mistral
    # 20 blocks hold 160 tokens: one 130-token sequence kept whole, five at once only windowed
    llm = _llm(model_dir, loraplex_home, num_blocks=20, enable_prefix_caching=prefix_caching)
    assert llm.engine.block_manager.sliding_window == WINDOW
    assert _generate_checked(llm, prompts) == want
    assert llm.engine.stats()["num_preemptions"] == 0
    if prefix_caching:  # again: the shared prefix and the first run's prompts hit the cache
        assert _generate_checked(llm, prompts) == want
        assert llm.engine.stats()["prefix_cache_hits"] >= 3 * 24


def test_chunks_crossing_the_window_edge(mistral, loraplex_home):
    """7 tokens a step: prompt chunks start at every offset to the window and block edges."""
    model_dir, prompts, want = mistral
    llm = _llm(model_dir, loraplex_home, num_blocks=20, max_num_batched_tokens=7)
    assert _generate_checked(llm, prompts) == want
    assert llm.engine.stats()["num_chunked_prefills"] >= 20


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preempted_sequences_recompute_exactly(mistral, loraplex_home, prefix_caching):
    model_dir, prompts, want = mistral
    prompts, want = prompts * 2, want * 2  # ten sequences, three windows' blocks each, 20 blocks
    llm = _llm(model_dir, loraplex_home, num_blocks=20, max_num_seqs=10, enable_prefix_caching=prefix_caching)
    assert _generate_checked(llm, prompts) == want
    assert llm.engine.stats()["num_preemptions"] > 0


def test_each_layers_window_decides_the_kv_groups():
    from loraplex.engine.kv_layout import KVLayout

    base = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
            "num_attention_heads": 4, "max_position_embeddings": 4096}
    mistral = ModelSpec.from_dict({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 40})
    no_window = ModelSpec.from_dict({**base, "architectures": ["MistralForCausalLM"], "sliding_window": None})
    llama = ModelSpec.from_dict({**base, "architectures": ["LlamaForCausalLM"], "sliding_window": 40})
    gemma2 = ModelSpec.from_dict({**base, "architectures": ["Gemma2ForCausalLM"], "sliding_window": 40})
    gemma3_windowed = ModelSpec.from_dict({**base, "architectures": ["Gemma3ForCausalLM"], "sliding_window": 40,
                                           "layer_types": ["sliding_attention"] * 3})
    assert mistral.uniform_sliding_window == 40
    assert no_window.uniform_sliding_window is None and llama.uniform_sliding_window is None
    # Gemma 2 alternates global layers, which read every block: they keep theirs in a group of
    # their own (3 layers: groups of one layer), the windowed layers give back theirs
    assert gemma2.gemma.layer_window(0) == 40 and gemma2.uniform_sliding_window is None
    assert gemma3_windowed.uniform_sliding_window == 40
    groups = {name: KVLayout.from_layer_windows(spec.layer_windows).group_windows for name, spec in
              [("mistral", mistral), ("no_window", no_window), ("llama", llama), ("gemma2", gemma2),
               ("gemma3_windowed", gemma3_windowed)]}
    assert groups == {"mistral": (40,), "no_window": (None,), "llama": (None,), "gemma2": (None, 40, 40),
                      "gemma3_windowed": (40,)}


def test_context_longer_than_the_kv_cache(mistral, loraplex_home):
    """Six blocks hold 48 tokens, less than the 70-token prompt plus 60 generated: a windowed
    sequence never holds more than its window's blocks and a 7-token chunk's (5 blocks here:
    12 - 1 + 7 positions over one block more), so the context is not lowered to the cache."""
    model_dir, prompts, want = mistral
    llm = _llm(model_dir, loraplex_home, num_blocks=6, max_num_batched_tokens=7, max_num_seqs=2)
    assert llm.engine.max_model_len == llm.engine.runner.max_model_len > 6 * BLOCK
    long_prompt = max(prompts, key=len)
    assert len(long_prompt) + MAX_TOKENS > 6 * BLOCK
    assert _generate_checked(llm, prompts) == want


def test_without_chunks_the_context_stays_within_the_kv_cache(mistral, loraplex_home):
    """Without chunked prefill a prompt is computed whole in one step, so it needs all its blocks
    at once: the context is lowered to what the cache holds, as for a model with global layers."""
    model_dir, _, _ = mistral
    llm = _llm(model_dir, loraplex_home, num_blocks=6, max_num_batched_tokens=64, enable_chunked_prefill=False)
    assert llm.engine.max_model_len == 6 * BLOCK
