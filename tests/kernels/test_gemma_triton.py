"""Gemma 2 and Gemma 3 on the Triton path, under the interpreter (CPU tensors, float32): the whole
decoder with dispatch forced to the Triton kernels (per-layer sliding window, Gemma 2's
attention soft-cap, head_dim 32 apart from hidden / heads) against transformers' own model, over
a prefill and a mixed paged step past the 24-position window; then (slow) greedy decoding
through CUDA-graph decode steps (replayed eagerly) with a PEFT adapter, token-identical to PEFT.
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.peft_adapters import make_peft_adapter
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.kernels.graph_decode import check_graph_decodes_match_peft
from tests.model.helpers import chunk_metadata, new_kv_caches, relative_error

from loraplex.kernels import dispatch  # noqa: E402

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture
def triton_on_cpu(monkeypatch):
    monkeypatch.setattr(dispatch, "uses_triton", lambda t: True)


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp(f"{request.param}-triton"), request.param, seed=2)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return model_dir, hf


def test_decoder_on_triton_kernels_matches_transformers(gemma, triton_on_cpu):
    """Step 1 prefills A's first 20 tokens and all but the last of B; step 2 runs A's next 20
    over its cached prefix (past the window) and one decode of B at position 34."""
    from loraplex.model.config import ModelSpec
    from loraplex.model.loader import load_model

    model_dir, hf = gemma
    spec = ModelSpec.from_dir(model_dir)
    ours = load_model(model_dir, spec, torch.float32, "cpu", max_positions=128)
    gen = torch.Generator().manual_seed(3)
    seq_a, seq_b = (torch.randint(4, 300, (n,), generator=gen).tolist() for n in (40, 35))
    kv = new_kv_caches(spec, 8, 16)
    positions, attn = chunk_metadata([(0, 20, [3, 6, 2]), (0, 34, [1, 4, 7])], 16)
    first = ours.compute_logits(ours(torch.tensor(seq_a[:20] + seq_b[:34]), positions, attn, kv))
    positions, attn = chunk_metadata([(20, 20, [3, 6, 2]), (34, 1, [1, 4, 7])], 16)
    second = ours.compute_logits(ours(torch.tensor(seq_a[20:] + seq_b[34:]), positions, attn, kv))
    with torch.no_grad():
        ref_a, ref_b = (hf(torch.tensor([s])).logits[0] for s in (seq_a, seq_b))
    assert relative_error(first, torch.cat([ref_a[:20], ref_b[:34]])) < 1e-4
    assert relative_error(second, torch.cat([ref_a[20:], ref_b[34:]])) < 1e-4


@pytest.mark.slow
def test_graph_decode_steps_with_lora_match_peft(gemma, triton_on_cpu, tmp_path):
    model_dir, hf = gemma
    adapter = make_peft_adapter(hf, tmp_path / "all", seed=31, r=8, lora_alpha=16, target_modules=SEVEN)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(4, 300, (n,), generator=gen).tolist() for n in (30, 3, 22)]
    check_graph_decodes_match_peft(model_dir, hf, {"all": adapter}, prompts, ["all", None, "all"], tmp_path / "home")
