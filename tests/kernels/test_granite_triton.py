"""Granite on the Triton path, under the interpreter (CPU tensors, float32/float16).

Granite's softmax scale is its ``attention_multiplier``, not 1/sqrt(head_dim): the attention
kernel (plain and split-KV) must honour the scale it is given, checked against its torch
reference. Then the whole decoder with dispatch forced to the Triton kernels, against
transformers' ``GraniteForCausalLM``: logits over a prefill and a mixed paged step, and greedy
decoding through CUDA-graph decode steps (replayed eagerly) with a PEFT adapter on all seven
projections, token-identical to PEFT.
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.peft_adapters import make_peft_adapter
from tests.fixtures.tiny_models import GRANITE_MULTIPLIERS, make_tiny_model_dir
from tests.kernels.helpers import rel_err
from tests.kernels.test_triton_attention import TOL, _build_batch
from tests.kernels.graph_decode import check_graph_decodes_match_peft
from tests.model.helpers import chunk_metadata, new_kv_caches, relative_error

from loraplex.kernels import dispatch  # noqa: E402
from loraplex.kernels.attention_ref import paged_attention_ref  # noqa: E402
from loraplex.kernels.triton_attention import paged_attention_triton  # noqa: E402

# Granite 3.x's 1/128 (head_dim 128; ibm-granite/granite-3.1-8b-instruct), the tiny fixture's
# 0.6 and transformers' GraniteConfig default 1.0; head_dim 16 makes the usual scale 0.25
SCALES = [0.0078125, GRANITE_MULTIPLIERS["attention_multiplier"], 1.0]
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_attention_takes_the_granite_softmax_scale(scale, dtype, num_kv_splits):
    # prefill over a cached prefix, a fresh prefill and decodes (all split when num_kv_splits > 1)
    seqs = [(37, 1), (20, 9), (0, 12), (130, 1)]
    batch = _build_batch(seqs, 4, 2, 16, 16, dtype, seed=int(scale * 1000) + 7)
    batch["scale"] = scale
    out = torch.full(batch["query"].shape, float("nan"), dtype=dtype)
    paged_attention_triton(**batch, out=out, num_kv_splits=num_kv_splits)
    ref = paged_attention_ref(**batch)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[dtype]
    # the scale is not ignored: the usual 1/sqrt(head_dim) gives another result
    assert rel_err(paged_attention_ref(**{**batch, "scale": 16**-0.5}), ref) > 100 * TOL[dtype]


@pytest.fixture
def triton_on_cpu(monkeypatch):
    monkeypatch.setattr(dispatch, "uses_triton", lambda t: True)


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("granite-triton"), "granite", seed=2)
    return model_dir, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_decoder_on_triton_kernels_matches_transformers(granite, triton_on_cpu):
    """Step 1 prefills A's first 20 tokens and all but the last of B; step 2 runs A's next chunk
    over its cached prefix and one decode of B."""
    from loraplex.model.config import ModelSpec
    from loraplex.model.loader import load_model

    model_dir, hf = granite
    spec = ModelSpec.from_dir(model_dir)
    assert spec.softmax_scale == GRANITE_MULTIPLIERS["attention_multiplier"]
    ours = load_model(model_dir, spec, torch.float32, "cpu", max_positions=128)
    torch.manual_seed(3)
    seq_a, seq_b = torch.randint(4, 300, (33,)).tolist(), torch.randint(4, 300, (18,)).tolist()
    kv = new_kv_caches(spec, 8, 16)
    positions, attn = chunk_metadata([(0, 20, [3, 6]), (0, 17, [1, 4])], 16)
    first = ours.compute_logits(ours(torch.tensor(seq_a[:20] + seq_b[:17]), positions, attn, kv))
    positions, attn = chunk_metadata([(20, 13, [3, 6, 0]), (17, 1, [1, 4])], 16)
    second = ours.compute_logits(ours(torch.tensor(seq_a[20:] + seq_b[17:]), positions, attn, kv))
    with torch.no_grad():
        ref_a, ref_b = (hf(torch.tensor([s])).logits[0] for s in (seq_a, seq_b))
    assert relative_error(first, torch.cat([ref_a[:20], ref_b[:17]])) < 1e-4
    assert relative_error(second, torch.cat([ref_a[20:], ref_b[17:]])) < 1e-4


@pytest.mark.slow
def test_graph_decode_steps_with_lora_match_peft(granite, triton_on_cpu, tmp_path):
    model_dir, hf = granite
    adapter = make_peft_adapter(hf, tmp_path / "all", seed=31, r=8, lora_alpha=16, target_modules=SEVEN)
    prompts = [[5, 9, 200, 17, 44], [250, 3, 90], [12, 13, 14, 15, 16, 17, 18]]
    check_graph_decodes_match_peft(model_dir, hf, {"all": adapter}, prompts, ["all", None, "all"], tmp_path / "home")
