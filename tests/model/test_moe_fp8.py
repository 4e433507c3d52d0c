"""FP8 mixture-of-experts checkpoints (Qwen3-MoE / Mixtral / Qwen2-MoE; FineGrainedFP8 block scales,
compressed-tensors per-tensor and per-channel; per-expert and fused expert layouts) against
transformers on the same model's dequantized weights (``tests/fixtures/fp8_checkpoints``, the
test's own dequantization): logits of a prefill and of prefill-then-decode steps, fp32, on each
CPU path: experts kept fp8 and dequantized per expert run (the loop the CUDA kernels are tested
against; forced here) and the CPU default (dequantized once at load). Plus: the experts stay the
stored fp8 bytes with per-expert scales, the router stays unquantized, and an unquantized MoE
quantized at load (``quantization="fp8"``) matches a per-row fp8 reference."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex.model.config import ModelSpec
from loraplex.model.fp8_config import QUANTIZE_AT_LOAD
from loraplex.model.fp8_weights import FP8_DTYPE
from loraplex.model.loader import load_model, read_safetensors
from tests.fixtures.fp8_checkpoints import SCHEMES, write_fp8_pair
from tests.fixtures.tiny_moe import make_tiny_moe_dir
from tests.model.helpers import chunk_metadata, new_kv_caches, relative_error

BLOCK_SIZE = 16
CASES = {  # name -> (family, expert layout, scheme)
    "qwen3_moe-fp8-block": ("qwen3_moe", "per_expert", "fp8-block"),
    "qwen3_moe-ct-channel": ("qwen3_moe", "per_expert", "ct-channel"),
    "mixtral-ct-tensor": ("mixtral", "per_expert", "ct-tensor"),
    "mixtral-fp8-block": ("mixtral", "per_expert", "fp8-block"),
    "qwen2_moe-fp8-block": ("qwen2_moe", "per_expert", "fp8-block"),  # the shared expert fp8 too
    "qwen3_moe-fused-fp8-block": ("qwen3_moe", "fused", "fp8-block"),
    "mixtral-fused-fp8-tensor": ("mixtral", "fused", "fp8-tensor"),
    "qwen3_moe-ct-block-16x24": ("qwen3_moe", "per_expert", "ct-block"),  # ragged blocks (CPU only)
}
PATHS = ("experts-fp8", "cpu-default")


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    family, layout, scheme = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    src = make_tiny_moe_dir(root / "src", family, layout, seed=7)
    write_fp8_pair(src, root / "fp8", root / "reference", scheme)
    ref = AutoModelForCausalLM.from_pretrained(root / "reference", dtype=torch.float32).eval()
    return root / "fp8", CASES[request.param], ref


def _load(model_dir, path: str, **kwargs):
    spec = ModelSpec.from_dir(model_dir, **kwargs)
    model = load_model(model_dir, spec, torch.float32, "cpu", max_positions=256,
                       fp8_resident=True if path == "experts-fp8" else None)
    if path == "experts-fp8":
        model.prepacked = model.prepacked_head = None  # the model's own (fp8) weights run
    return spec, model


def _ref_logits(ref, tokens: list[int]) -> torch.Tensor:  # [len, vocab]
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0].float()


def _check_prefill_and_decode(spec, ours, ref) -> None:
    torch.manual_seed(1)
    seqs = [torch.randint(0, spec.vocab_size, (n,)).tolist() for n in (23, 9)]
    tables, prompt_lens = [[3, 8], [6]], [18, 4]
    kv = new_kv_caches(spec, 10, BLOCK_SIZE)
    full = [_ref_logits(ref, seq) for seq in seqs]
    for step in range(4):  # the prefill of both, then decode steps of one token each
        chunks = [(0, n, t) for n, t in zip(prompt_lens, tables)] if step == 0 else \
            [(n + step - 1, 1, t) for n, t in zip(prompt_lens, tables)]
        positions, attn = chunk_metadata(chunks, BLOCK_SIZE)
        ids = [tok for seq, (start, count, _) in zip(seqs, chunks) for tok in seq[start:start + count]]
        with torch.no_grad():
            logits = ours.compute_logits(ours(torch.tensor(ids), positions, attn, kv))
        expected = torch.cat([f[start:start + count] for f, (start, count, _) in zip(full, chunks)])
        assert relative_error(logits, expected) < 1e-4, f"step {step}"


@pytest.mark.parametrize("path", PATHS)
def test_prefill_and_decode_match_transformers_on_dequantized_weights(pair, path):
    model_dir, (family, _, _), ref = pair
    spec, ours = _load(model_dir, path)
    sparse = next(i for i, s in enumerate(spec.moe.sparse_layers) if s)
    assert (ours.layers[sparse].experts_gate_up.dtype == FP8_DTYPE) == (path == "experts-fp8")
    _check_prefill_and_decode(spec, ours, ref)


def test_experts_stay_the_stored_fp8_bytes_with_per_expert_scales(pair):
    model_dir, (family, layout, scheme), _ = pair
    spec, ours = _load(model_dir, "experts-fp8")
    raw = read_safetensors(model_dir)
    layer = ours.layers[0]
    e, i, h = spec.moe.num_experts, spec.moe.expert_intermediate_size, spec.hidden_size
    assert layer.experts_gate_up.dtype == layer.experts_down.dtype == FP8_DTYPE
    assert layer.experts_gate_up.shape == (e, 2 * i, h) and layer.experts_down.shape == (e, h, i)
    assert layer.experts_gate_up_scale.dtype == torch.float32 and layer.experts_gate_up_scale.shape[:2] == (e, 2 * i)
    assert layer.router_weight.dtype == torch.float32  # the router is stored unquantized
    if layout == "fused":
        stored = raw["model.layers.0.mlp.experts.gate_up_proj"]
    else:
        block, (g, u, _) = ("block_sparse_moe", ("w1", "w3", "w2")) if family == "mixtral" else \
            ("mlp", ("gate_proj", "up_proj", "down_proj"))
        stored = torch.stack([torch.cat([raw[f"model.layers.0.{block}.experts.{x}.{m}.weight"] for m in (g, u)])
                              for x in range(e)])
    assert torch.equal(layer.experts_gate_up.view(torch.uint8), stored.view(torch.uint8))
    if scheme == "ct-tensor":  # gate and up keep their own scalar inside gate_up, per expert
        s = layer.experts_gate_up_scale[:, :, 0]  # [E, 2I]
        assert torch.equal(s[:, :i], s[:, :1].expand(e, i)) and torch.equal(s[:, i:], s[:, i:i + 1].expand(e, i))
        assert not torch.equal(s[:, 0], s[:, i]) and len(set(s[:, 0].tolist())) == e


def test_unquantized_moe_quantized_at_load(tmp_path):
    """quantization="fp8" on an unquantized Qwen3-MoE: every projection and every expert fp8 with
    one scale per output row; logits equal transformers on the per-row fp8 reference the fixture
    computes (its "ct-channel-fp32" scheme is the same quantization)."""
    src = make_tiny_moe_dir(tmp_path / "src", "qwen3_moe", seed=9)
    write_fp8_pair(src, tmp_path / "fp8", tmp_path / "reference", "ct-channel-fp32")
    assert SCHEMES["ct-channel-fp32"][1] == ("channel",)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "reference", dtype=torch.float32).eval()
    spec, ours = _load(src, "experts-fp8", quantization="fp8")
    assert spec.weight_format == QUANTIZE_AT_LOAD
    assert ours.layers[0].experts_down.dtype == FP8_DTYPE and ours.layers[0].experts_down_scale.shape[-1] == 1
    assert ours.layers[1].gate_up_weight.dtype == FP8_DTYPE  # the dense layer too
    _check_prefill_and_decode(spec, ours, ref)


def test_refusals_name_what_is_not_served(tmp_path):
    """Blocks narrower than the kernels' 16-column K tile, refused at load for CUDA (before any
    device memory is touched); a layer whose experts are partly fp8, refused naming them."""
    from safetensors.torch import load_file, save_file

    src = make_tiny_moe_dir(tmp_path / "src", "qwen3_moe", seed=2)
    write_fp8_pair(src, tmp_path / "ct-block", tmp_path / "ref-block", "ct-block")  # 16x24 blocks
    spec = ModelSpec.from_dir(tmp_path / "ct-block")
    with pytest.raises(ValueError, match="blocks of 24 columns are not served on CUDA"):
        load_model(tmp_path / "ct-block", spec, torch.float32, "cuda", max_positions=64)
    write_fp8_pair(src, tmp_path / "mixed", tmp_path / "ref-mixed", "fp8-block")
    path = tmp_path / "mixed" / "model.safetensors"
    tensors = load_file(str(path))
    for m in ("gate_proj", "up_proj", "down_proj"):  # expert 2 of layer 0 stored unquantized
        name = f"model.layers.0.mlp.experts.2.{m}"
        tensors[name + ".weight"] = tensors[name + ".weight"].float()
        del tensors[name + ".weight_scale_inv"]
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=r"experts \['layers.0.mlp.experts.2.gate_proj'\] are stored unquantized"):
        load_model(tmp_path / "mixed", ModelSpec.from_dir(tmp_path / "mixed"), torch.float32, "cpu", max_positions=64)


@pytest.mark.parametrize("resident", [True, False], ids=["experts-fp8", "dequantized-at-load"])
def test_bfloat16_experts_are_the_reference_rounded_once(tmp_path, resident):
    """In bf16 each expert's weights, dequantized per run (fp8 kept) or once at load, are the
    reference's rounded to bf16 once (bf16 per-channel scales: fp8 value * scale is exact before
    that rounding): what the CPU loop multiplies by."""
    src = make_tiny_moe_dir(tmp_path / "src", "mixtral", seed=4)
    write_fp8_pair(src, tmp_path / "fp8", tmp_path / "ref", "ct-channel")
    spec = ModelSpec.from_dir(tmp_path / "fp8")
    ours = load_model(tmp_path / "fp8", spec, torch.bfloat16, "cpu", max_positions=64, fp8_resident=resident)
    ref = read_safetensors(tmp_path / "ref")
    layer = ours.layers[1]
    for e in (0, 5):
        expert = f"model.layers.1.block_sparse_moe.experts.{e}."
        want_gate_up = torch.cat([ref[expert + "w1.weight"], ref[expert + "w3.weight"]]).to(torch.bfloat16)
        want_down = ref[expert + "w2.weight"].to(torch.bfloat16)
        scales = ours.expert_scales(1)
        assert (scales is not None) == resident
        gate_up, down = (layer.experts_gate_up[e], layer.experts_down[e]) if scales is None else \
            scales.dequantize(layer.experts_gate_up, layer.experts_down, e, torch.bfloat16)
        assert torch.equal(gate_up, want_gate_up) and torch.equal(down, want_down)


def test_fused_per_tensor_scales_of_gate_and_up_halves():
    """transformers' FineGrainedFP8 experts keep a per-tensor gate_up scale of shape [E, 2, 1] (one
    for the gate half, one for the up half): each half's rows get its own, as dequantized by hand."""
    from loraplex.model.fp8_config import Fp8WeightFormat
    from loraplex.model.moe_weights import take_experts

    e, i, h = 3, 4, 8
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(e, 2 * i, h, generator=gen) * 50).to(FP8_DTYPE)
    down = (torch.randn(e, h, i, generator=gen) * 50).to(FP8_DTYPE)
    raw = {"mlp.experts.gate_up_proj": gate_up, "mlp.experts.gate_up_proj_scale_inv": torch.rand(e, 2, 1) + 0.1,
           "mlp.experts.down_proj": down, "mlp.experts.down_proj_scale_inv": torch.rand(e, 1, 1) + 0.1}
    want_gu = torch.cat([gate_up[:, :i].float() * raw["mlp.experts.gate_up_proj_scale_inv"][:, :1],
                         gate_up[:, i:].float() * raw["mlp.experts.gate_up_proj_scale_inv"][:, 1:]], dim=1)
    want_dn = down.float() * raw["mlp.experts.down_proj_scale_inv"]
    got_gu, got_dn = take_experts(dict(raw), raw.pop, "mlp.", ("gate_proj", "up_proj", "down_proj"), e,
                                  Fp8WeightFormat("fp8", "tensor"))
    assert raw == {}  # every tensor used
    assert torch.equal(got_gu.weight.view(torch.uint8), gate_up.view(torch.uint8))
    assert torch.equal(got_gu.weight.float() * got_gu.scale, want_gu)
    assert torch.equal(got_dn.weight.float() * got_dn.scale, want_dn)
