"""PEFT adapters served on an FP8 mixture-of-experts base (Qwen3-MoE with FineGrainedFP8 16x16 blocks,
Mixtral with compressed-tensors per-channel scales, Qwen2-MoE per tensor with its shared expert
adapted too): greedy outputs of a mixed batch (base-only, an attention adapter, expert adapters:
PEFT ``target_parameters`` on the fused experts) equal PEFT on transformers' model of the
dequantized weights, token for token (float32), with the experts kept fp8 (the per-expert
dequantizing loop the CUDA kernels are tested against) and dequantized at load (the CPU default)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex import LLM, SamplingParams
from loraplex.model import loader
from tests.fixtures.fp8_checkpoints import write_fp8_pair
from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for
from tests.fixtures.tiny_moe import make_tiny_moe_dir
from tests.lora.test_acceptance import reference
from tests.lora.test_moe_expert_lora import _adapters

CASES = {"qwen3_moe": "fp8-block", "mixtral": "ct-channel", "qwen2_moe": "ct-tensor"}  # Qwen2-MoE: shared expert LoRA too


@pytest.fixture(scope="module", params=sorted(CASES))
def world(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(f"fp8-moe-lora-{family}")
    src = make_tiny_moe_dir(root / "src", family, seed=12)
    write_fp8_pair(src, root / "fp8", root / "reference", CASES[family])
    base = AutoModelForCausalLM.from_pretrained(str(root / "reference"), dtype=torch.float32).eval()
    adapters = _adapters(family)
    dirs = {name: make_peft_adapter(base, root / name, seed=40 + i, **adapters[name])
            for i, name in enumerate(("attn", "experts"))}
    return root, dirs, peft_model_for(base, dirs)


@pytest.mark.parametrize("path", ["experts-fp8", "cpu-default"])
def test_mixed_batch_on_fp8_moe_base_matches_peft_on_dequantized_base(world, path):
    root, dirs, peft_model = world
    with pytest.MonkeyPatch.context() as mp:
        if path == "experts-fp8":
            mp.setattr(loader, "experts_stay_fp8", lambda device, fp8_resident: True)
        llm = LLM(model=str(root / "fp8"), dtype="float32", device="cpu", home=root / "home", max_loras=2,
                  max_lora_rank=4, kv_cache_bytes=4 << 20, enable_expert_lora=True)
    model = llm.engine.runner.model
    assert (model.layers[0].experts_gate_up.dtype == torch.float8_e4m3fn) == (path == "experts-fp8")
    prompts = [[5 + (7 * i + j) % 250 for j in range(6 + i)] for i in range(5)]
    which = [None, "attn", "experts", "experts", None]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                        adapters=[None if w is None else str(dirs[w]) for w in which])
    expected = [reference(peft_model, prompt, adapter, 6) for prompt, adapter in zip(prompts, which)]
    assert [out.token_ids for out in outs] == expected
    # the expert adapter changes what it generates (the test means something)
    assert expected[2] != reference(peft_model, prompts[2], None, 6)


def test_start_up_counts_fp8_experts_at_one_byte(world, caplog):
    """The runner's weight bytes (logged at start; on CUDA the KV budget is measured once they are
    in) count each fp8 expert element as one byte: the fp8 engine holds what the dequantized one
    holds less 3 bytes per expert element, plus the expert scales."""
    root, _, _ = world
    sizes = {}
    for path in ("experts-fp8", "cpu-default"):
        with pytest.MonkeyPatch.context() as mp:
            if path == "experts-fp8":
                mp.setattr(loader, "experts_stay_fp8", lambda device, fp8_resident: True)
            with caplog.at_level("INFO"):
                llm = LLM(model=str(root / "fp8"), dtype="float32", device="cpu", home=root / "home",
                          kv_cache_bytes=4 << 20)
        runner = llm.engine.runner
        sizes[path] = runner.weight_bytes
        layers = [layer for layer in runner.model.layers if hasattr(layer, "experts_gate_up")]
        elements = sum(layer.experts_gate_up.numel() + layer.experts_down.numel() for layer in layers)
        scales = sum(layer.experts_gate_up_scale.nbytes + layer.experts_down_scale.nbytes for layer in layers) \
            if path == "experts-fp8" else 0
        sizes[path + "-elements"], sizes[path + "-scales"] = elements, scales
        assert f"weights {runner.weight_bytes / (1 << 20):.1f} MiB" in caplog.text
    assert sizes["experts-fp8"] == sizes["cpu-default"] - 3 * sizes["cpu-default-elements"] + sizes["experts-fp8-scales"]
    assert "stacked expert weights" in caplog.text and "kept fp8" in caplog.text
