"""Block freeing on the other models windowed on every layer: a Phi-3 with a sliding window and a
Gemma 3 whose layers are all windowed (``uniform_sliding_window``) generate through a KV pool too
small to keep their sequences whole, with prefix caching on a prompt prefix past the window, and
match transformers' greedy tokens exactly (float32); every block is free at the end. (Mistral:
test_window_kv_exact.py.)"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex.engine.llm import LLM
from loraplex.model.config import ModelSpec
from loraplex.sampling_params import SamplingParams
from tests.engine.test_engine_exact import kv_bytes_per_token
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.fixtures.tiny_phi3 import make_tiny_phi3_dir
from tests.lora.test_acceptance import greedy

WINDOW, BLOCK, NUM_BLOCKS, MAX_TOKENS = 10, 4, 24, 24


def _make(kind: str, path):
    if kind == "phi3":
        return make_tiny_phi3_dir(path, seed=5, sliding_window=WINDOW)
    return make_tiny_model_dir(path, "gemma3", seed=5, sliding_window=WINDOW, layer_types=["sliding_attention"] * 3)


@pytest.mark.parametrize("kind", ["phi3", "gemma3"])
def test_windowed_model_frees_blocks_and_matches_transformers(kind, tmp_path, loraplex_home):
    model_dir = _make(kind, tmp_path / kind)
    assert ModelSpec.from_dir(model_dir).uniform_sliding_window == WINDOW
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(4, 300, (17,), generator=gen).tolist()
    prompts = [shared + torch.randint(4, 300, (n,), generator=gen).tolist() for n in (2, 11)]
    prompts.append(torch.randint(4, 300, (3,), generator=gen).tolist())
    # 24 blocks of 4 hold 96 tokens: three sequences of up to 52 tokens run together only windowed
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=loraplex_home, block_size=BLOCK,
              kv_cache_bytes=NUM_BLOCKS * BLOCK * kv_bytes_per_token(model_dir), max_num_batched_tokens=16,
              max_num_seqs=4, enable_prefix_caching=True)
    assert llm.engine.block_manager.sliding_window == WINDOW
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == [greedy(ref, p, MAX_TOKENS) for p in prompts]
    stats = llm.engine.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"] == NUM_BLOCKS
    assert stats["prefix_cache_hits"] >= 16  # the second prompt found the shared prefix
