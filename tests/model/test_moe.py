"""Mixture-of-experts decoders (Mixtral, Qwen3-MoE, Qwen2-MoE) against transformers' own models from
the same random weights (fp32, CPU), each from both checkpoint layouts (per-expert as published
and as ``save_pretrained`` writes by default; fused as transformers 5 holds it in memory): logits
of a prefill and of several decode steps over the paged cache; the sparse block against
transformers' block with an expert no token picks; which layers are sparse, as transformers
decides it; config refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex.model.config import ModelSpec, UnsupportedModelError
from loraplex.model.loader import load_model, read_safetensors
from loraplex.model.moe import MoEForCausalLM, route_tokens, run_experts
from tests.fixtures.tiny_moe import FAMILIES, make_tiny_moe_dir, moe_hf_config
from tests.model.helpers import chunk_metadata, new_kv_caches, relative_error

BLOCK_SIZE = 16
HF_CLASSES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


@pytest.fixture(scope="module", params=[(f, layout) for f in sorted(FAMILIES) for layout in ("per_expert", "fused")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def variant(request, tmp_path_factory):
    family, layout = request.param
    model_dir = make_tiny_moe_dir(tmp_path_factory.mktemp(f"{family}-{layout}"), family, layout, seed=3)
    stored = read_safetensors(model_dir)
    if layout == "fused":
        assert "model.layers.0.mlp.experts.gate_up_proj" in stored
    else:
        expert = "block_sparse_moe.experts.5.w1" if family == "mixtral" else "mlp.experts.5.gate_proj"
        assert f"model.layers.0.{expert}.weight" in stored
    spec = ModelSpec.from_dir(model_dir)
    ours = load_model(model_dir, spec, torch.float32, "cpu", max_positions=256)
    assert isinstance(ours, MoEForCausalLM)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert type(ref).__name__ == HF_CLASSES[family]
    return spec, ours, ref


def ref_logits(ref, token_ids: list[int]) -> torch.Tensor:  # [len, vocab]
    with torch.no_grad():
        return ref(torch.tensor([token_ids])).logits[0].float()


def test_prefill_logits_match_transformers(variant):
    spec, ours, ref = variant
    torch.manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (70,)).tolist()
    positions, attn = chunk_metadata([(0, len(tokens), [5, 2, 9, 0, 7])], BLOCK_SIZE)
    logits = ours.compute_logits(ours(torch.tensor(tokens), positions, attn, new_kv_caches(spec, 10, BLOCK_SIZE)))
    assert relative_error(logits, ref_logits(ref, tokens)) < 1e-4


def test_prefill_then_decode_steps_match_transformers(variant):
    """Two sequences prefilled in one step, then five decode steps of both (two tokens a step:
    four (token, expert) pairs over six experts, so some expert gets no token every step); each
    step's rows against transformers' logits of the whole sequence."""
    spec, ours, ref = variant
    torch.manual_seed(1)
    seqs = [torch.randint(0, spec.vocab_size, (n,)).tolist() for n in (23, 9)]
    tables = [[3, 8], [6]]
    prompt_lens = [18, 4]
    kv = new_kv_caches(spec, 10, BLOCK_SIZE)
    positions, attn = chunk_metadata([(0, n, t) for n, t in zip(prompt_lens, tables)], BLOCK_SIZE)
    ids = [tok for seq, n in zip(seqs, prompt_lens) for tok in seq[:n]]
    logits = ours.compute_logits(ours(torch.tensor(ids), positions, attn, kv))
    full = [ref_logits(ref, seq) for seq in seqs]
    expected = torch.cat([f[:n] for f, n in zip(full, prompt_lens)])
    assert relative_error(logits, expected) < 1e-4
    for step in range(5):
        chunks = [(n + step, 1, t) for n, t in zip(prompt_lens, tables)]
        positions, attn = chunk_metadata(chunks, BLOCK_SIZE)
        ids = [seq[n + step] for seq, n in zip(seqs, prompt_lens)]
        logits = ours.compute_logits(ours(torch.tensor(ids), positions, attn, kv))
        expected = torch.stack([f[n + step] for f, n in zip(full, prompt_lens)])
        assert relative_error(logits, expected) < 1e-4, f"decode step {step}"


def _hf_sparse_block(family: str, **overrides):
    config = moe_hf_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    return model.model.layers[0].mlp


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sparse_block_matches_transformers_with_an_unpicked_expert(family):
    """Seven tokens, top-2 of six experts; expert 4's router row is pushed down so no token
    picks it, and the tokens spread over the rest. ``route_tokens`` + ``run_experts`` (plus the
    shared expert for Qwen2-MoE, via the model's ``_mlp``) against transformers' block."""
    torch.manual_seed(5)
    block = _hf_sparse_block(family)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
        block.gate.weight[4] = -10.0 * block.gate.weight[4].sign()
    x = torch.randn(7, 64)
    with torch.no_grad():
        want = block(x[None])[0]
    spec = ModelSpec.from_dict(moe_hf_config(family).to_dict())
    weights, experts = route_tokens(x, block.gate.weight, spec.moe)
    assert 4 not in experts.tolist()
    assert len(set(experts.flatten().tolist())) >= 4  # tokens do go to different experts
    got = run_experts(x, weights, experts, block.experts.gate_up_proj, block.experts.down_proj)
    if spec.moe.shared_expert_intermediate_size:
        shared = block.shared_expert
        s = torch.nn.functional.linear
        act = torch.nn.functional.silu(s(x, shared.gate_proj.weight)) * s(x, shared.up_proj.weight)
        got = got + torch.sigmoid(s(x, block.shared_expert_gate.weight)) * s(act, shared.down_proj.weight)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_run_experts_against_a_per_token_loop():
    """Every token's output is the routing-weighted sum of its experts' SwiGLU, whatever order
    the experts are grouped in; experts 1 and 3 get no token."""
    torch.manual_seed(6)
    x = torch.randn(5, 8)
    gate_up, down = torch.randn(4, 12, 8), torch.randn(4, 8, 6)
    experts = torch.tensor([[0, 2], [2, 0], [0, 0], [2, 2], [0, 2]])
    weights = torch.rand(5, 2)
    got = run_experts(x, weights, experts, gate_up, down)
    for t in range(5):
        want = torch.zeros(8)
        for j in range(2):
            e = int(experts[t, j])
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            want += weights[t, j] * (down[e] @ (torch.nn.functional.silu(gate) * up))
        assert torch.allclose(got[t], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("overrides", [dict(decoder_sparse_step=2), dict(mlp_only_layers=[0, 2]),
                                       dict(decoder_sparse_step=2, mlp_only_layers=[1])])
def test_sparse_layers_are_the_layers_transformers_makes_sparse(family, overrides):
    config = moe_hf_config(family, num_hidden_layers=4, **overrides)
    model = AutoModelForCausalLM.from_config(config)
    want = tuple(type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in model.model.layers)
    assert ModelSpec.from_dict(config.to_dict()).moe.sparse_layers == want


def test_published_qwen3_moe_config_keys():
    """Qwen3-30B-A3B's config.json says ``num_experts`` (transformers 5 writes
    ``num_local_experts``); both name the expert count."""
    saved = moe_hf_config("qwen3_moe").to_dict()
    assert "num_experts" not in saved and saved["num_local_experts"] == 6
    published = {k: v for k, v in saved.items() if k != "num_local_experts"} | {"num_experts": 128,
                                                                               "num_experts_per_tok": 8}
    moe = ModelSpec.from_dict(published).moe
    assert (moe.num_experts, moe.top_k, moe.norm_topk_prob, moe.expert_intermediate_size) == (128, 8, True, 32)


def test_mixtral_sliding_window_is_read_as_mistral():
    assert ModelSpec.from_dict(moe_hf_config("mixtral").to_dict()).sliding_window is None
    assert ModelSpec.from_dict(moe_hf_config("mixtral", sliding_window=100).to_dict()).sliding_window == 100


@pytest.mark.parametrize(
    "family, overrides, message",
    [
        ("mixtral", dict(num_experts_per_tok=7), "num_experts_per_tok 7 exceeds num_local_experts 6"),
        ("qwen3_moe", dict(num_experts_per_tok=0), "num_experts_per_tok must be a positive integer"),
        ("qwen3_moe", dict(use_sliding_window=True, sliding_window=64), "sliding-window attention is not supported"),
    ],
)
def test_bad_configs_are_refused(family, overrides, message):
    raw = {**moe_hf_config(family).to_dict(), **overrides}
    with pytest.raises(UnsupportedModelError, match=message):
        ModelSpec.from_dict(raw)


def test_checkpoint_with_too_few_experts_is_refused(tmp_path):
    import json

    model_dir = make_tiny_moe_dir(tmp_path / "m", "qwen3_moe", "fused")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "num_experts": 8}))
    spec = ModelSpec.from_dir(model_dir)
    with pytest.raises(ValueError, match=r"shapes \[6, 64, 64\] \(gate_up\) and \[6, 64, 32\] \(down\); "
                                         r"the config needs 8 experts of intermediate size 32"):
        load_model(model_dir, spec, torch.float32, "cpu", 64)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sparse_block_in_bfloat16_rounds_as_transformers(family):
    """In bf16 the roundings matter: Mixtral scales each expert's output by the fp32 weight, the
    Qwen MoEs round the weights to bf16 first, and a token's k outputs are summed in fp32 and
    rounded once (transformers 5's default grouped_mm path; an index_add in bf16 differs):
    bit-equal to transformers' bf16 block."""
    torch.manual_seed(7)
    block = _hf_sparse_block(family)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    block = block.to(torch.bfloat16)
    x = torch.randn(9, 64).to(torch.bfloat16)
    with torch.no_grad():
        want = block(x[None])[0]
    moe = ModelSpec.from_dict(moe_hf_config(family).to_dict()).moe
    weights, experts = route_tokens(x, block.gate.weight, moe)
    assert weights.dtype == (torch.float32 if family == "mixtral" else torch.bfloat16)
    got = run_experts(x, weights, experts, block.experts.gate_up_proj, block.experts.down_proj)
    if moe.shared_expert_intermediate_size:
        shared = block.shared_expert
        got = got + torch.sigmoid(torch.nn.functional.linear(x, block.shared_expert_gate.weight)) * shared(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_cpu_dispatch_keeps_the_torch_path(monkeypatch):
    """On CPU tensors ``dispatch.fused_moe`` is the torch loop, bit for bit, and never the Triton
    launcher (the engine's CPU outputs stay what they were)."""
    from loraplex.kernels import dispatch, triton_moe

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton MoE path ran on CPU tensors")

    monkeypatch.setattr(triton_moe, "fused_moe_triton", refuse)
    torch.manual_seed(8)
    x = torch.randn(6, 16).to(torch.bfloat16)
    gate_up, down = torch.randn(4, 20, 16).to(torch.bfloat16), torch.randn(4, 16, 10).to(torch.bfloat16)
    weights, experts = torch.topk(torch.softmax(torch.randn(6, 4), dim=-1), 2, dim=-1)
    got = dispatch.fused_moe(x, weights, experts, gate_up, down)
    assert torch.equal(got, run_experts(x, weights, experts, gate_up, down))
