"""One-step logits of loraplex's decoder against transformers' own model (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex.model.config import ModelSpec
from loraplex.model.loader import load_model
from tests.fixtures.tiny_models import GRANITE_MULTIPLIERS, make_tiny_model_dir
from tests.model.helpers import chunk_metadata, new_kv_caches, relative_error

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
VARIANTS = {
    "llama-gqa": ("llama", {}),
    "qwen2-bias": ("qwen2", {}),
    "tied": ("tied", {}),
    "mistral": ("mistral", {"num_key_value_heads": 1}),
    "qwen3-qk-norm": ("qwen3", {}),
    "llama-mha": ("llama", {"num_key_value_heads": 4}),
    "rope-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "rope-llama3": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
    "old-config-form": ("qwen2", {"config_form": "old", "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    # Qwen's recipe for long contexts (factor 4 over the original context); the prompts run past it
    "rope-yarn": ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}),
    # DeepSeek-style: mscale / mscale_all_dim set the temperature; untruncated correction range
    "rope-yarn-mscale": ("llama", {"rope_scaling": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 1.0,
        "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2, "truncate": False}}),
    "granite": ("granite", {}),  # tests.fixtures.tiny_models.GRANITE_MULTIPLIERS
    "granite-tied": ("granite", {"tie_word_embeddings": True}),  # embedding_multiplier not on the head
    # all 1: the softmax scale is then 1, not 1/sqrt(head_dim)
    "granite-unit": ("granite", {k: 1.0 for k in GRANITE_MULTIPLIERS}),
}
BLOCK_SIZE = 16


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    kind, overrides = VARIANTS[request.param]
    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), kind, seed=1, **overrides)
    spec = ModelSpec.from_dir(model_dir)
    ours = load_model(model_dir, spec, torch.float32, "cpu", max_positions=512)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return spec, ours, ref


def ref_logits(ref, token_ids: list[int]) -> torch.Tensor:  # [len, vocab]
    with torch.no_grad():
        return ref(torch.tensor([token_ids])).logits[0].float()


def test_prefill_logits_match_transformers(variant):
    spec, ours, ref = variant
    torch.manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (150,)).tolist()
    table = [5, 2, 9, 0, 7, 3, 11, 1, 4, 6]  # scattered blocks: paging must not matter
    positions, attn = chunk_metadata([(0, len(tokens), table)], BLOCK_SIZE)
    kv = new_kv_caches(spec, 12, BLOCK_SIZE)
    logits = ours.compute_logits(ours(torch.tensor(tokens), positions, attn, kv))
    assert logits.dtype == torch.float32
    assert relative_error(logits, ref_logits(ref, tokens)) < 1e-4


def test_mixed_step_matches_transformers(variant):
    """Step 1 prefills A's first 20 tokens and all of B and C; step 2 mixes A's next chunk (over
    its cached prefix), one decode of B and one of C. Each row must equal transformers' logits at
    that position of the full sequence."""
    spec, ours, ref = variant
    torch.manual_seed(1)
    seq_a = torch.randint(0, spec.vocab_size, (45,)).tolist()
    seq_b = torch.randint(0, spec.vocab_size, (18,)).tolist()
    seq_c = torch.randint(0, spec.vocab_size, (33,)).tolist()
    tables = {"a": [3, 8, 1], "b": [6, 0], "c": [2, 9, 4]}
    kv = new_kv_caches(spec, 10, BLOCK_SIZE)

    step1 = [(0, 20, tables["a"]), (0, 17, tables["b"]), (0, 32, tables["c"])]
    ids1 = seq_a[:20] + seq_b[:17] + seq_c[:32]
    positions, attn = chunk_metadata(step1, BLOCK_SIZE)
    ours(torch.tensor(ids1), positions, attn, kv)

    step2 = [(20, 25, tables["a"]), (17, 1, tables["b"]), (32, 1, tables["c"])]
    ids2 = seq_a[20:45] + seq_b[17:18] + seq_c[32:33]
    positions, attn = chunk_metadata(step2, BLOCK_SIZE)
    logits = ours.compute_logits(ours(torch.tensor(ids2), positions, attn, kv))  # [27, vocab]

    expected = torch.cat([ref_logits(ref, seq_a)[20:45], ref_logits(ref, seq_b)[17:18], ref_logits(ref, seq_c)[32:33]])
    assert relative_error(logits, expected) < 1e-4
