"""Mistral's sliding window is a real window on every layer: logits and greedy tokens against
transformers' ``MistralForCausalLM`` with a window of 24 positions (not a whole number of
16-token blocks), on prompts and outputs that run far past it (float32, CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex.model.config import ModelSpec
from loraplex.model.loader import load_model
from loraplex.sampling_params import SamplingParams
from tests.engine.test_engine_exact import tight_llm
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.lora.test_acceptance import greedy
from tests.model.helpers import chunk_metadata, new_kv_caches, relative_error

WINDOW = 24


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("mistral-window"), "mistral", seed=3, sliding_window=WINDOW)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    assert ref.config.sliding_window == WINDOW
    return model_dir, ModelSpec.from_dir(model_dir), ref


def _logits(model_dir, spec, tokens: list[int]) -> torch.Tensor:  # [len, vocab]
    ours = load_model(model_dir, spec, torch.float32, "cpu", max_positions=512)
    positions, attn = chunk_metadata([(0, 100, [4, 1, 6, 0, 2, 5, 3]), (0, 20, [7, 8])], 16)
    seq_b = tokens[::-1][:20]
    hidden = ours(torch.tensor(tokens + seq_b), positions, attn, new_kv_caches(spec, 9, 16))
    return ours.compute_logits(hidden)[:100]


def test_logits_match_transformers_past_the_window(mistral):
    model_dir, spec, ref = mistral
    assert spec.sliding_window == WINDOW
    tokens = torch.randint(0, spec.vocab_size, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        want = ref(torch.tensor([tokens])).logits[0]
    assert relative_error(_logits(model_dir, spec, tokens), want) < 1e-4
    # attending to the whole context (loraplex before the window was real) is far off here
    full = _logits(model_dir, dataclasses.replace(spec, sliding_window=None), tokens)
    assert relative_error(full, want) > 1e-2


def test_greedy_generation_matches_transformers(mistral, loraplex_home):
    """Chunked prompts (64 tokens a step), then decodes through the paged KV cache."""
    model_dir, _, ref = mistral
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(4, 300, (n,), generator=gen).tolist() for n in (5, 30, 90)]
    llm = tight_llm(model_dir, loraplex_home, num_blocks=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == [greedy(ref, p, 12) for p in prompts]


@pytest.mark.parametrize("window", [0, -4, 2.5, "4096", True])
def test_a_window_that_is_not_a_positive_integer_is_refused(window):
    from loraplex.model.config import UnsupportedModelError

    cfg = {"architectures": ["MistralForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "sliding_window": window}
    with pytest.raises(UnsupportedModelError, match="sliding_window"):
        ModelSpec.from_dict(cfg)


@pytest.mark.parametrize("keys", [{"max_position_embeddings": 8192}, {"sliding_window": None}, {"sliding_window": 512},
                                  {"max_position_embeddings": 4096}, {}])
def test_window_left_out_is_transformers_default(keys):
    """``MistralConfig`` fills in a 4096-position window when config.json leaves the key out (an
    explicit null: none), so such a checkpoint slides in transformers past 4096 tokens."""
    from transformers import MistralConfig

    shape = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4}
    spec = ModelSpec.from_dict({"architectures": ["MistralForCausalLM"], **shape, **keys})
    hf = MistralConfig(**shape, **keys)
    # a window no served context reaches masks nothing (loraplex then keeps every block)
    want = hf.sliding_window if hf.sliding_window is not None and hf.sliding_window < spec.max_context_len else None
    assert spec.layer_windows == (want,) * 2
