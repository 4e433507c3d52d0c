"""FP8 experts whose intermediate size is not a multiple of the block rows (moe_intermediate_size
40 in 16x16 blocks; Qwen3-30B-A3B's 768 is a multiple of 128, other MoEs' need not be): each of
gate, up and down carries its own ``[ceil(out / 16), ceil(in / 16)]`` grid, so gate's last block
covers 8 rows and up starts a fresh block inside the stacked ``gate_up``. Logits equal transformers'
on the dequantized weights on both CPU paths and on the fused Triton kernels (interpreter)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex.kernels import dispatch
from tests.fixtures.fp8_checkpoints import write_fp8_pair
from tests.fixtures.tiny_moe import make_tiny_moe_dir
from tests.model.test_moe_fp8 import _check_prefill_and_decode, _load


@pytest.fixture(scope="module")
def ragged(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-ragged-rows")
    src = make_tiny_moe_dir(root / "src", "qwen3_moe", "per_expert", seed=7, moe_intermediate_size=40)
    write_fp8_pair(src, root / "fp8", root / "reference", "fp8-block")
    return root / "fp8", AutoModelForCausalLM.from_pretrained(root / "reference", dtype=torch.float32).eval()


@pytest.mark.parametrize("path", ["experts-fp8", "cpu-default", "triton"])
def test_ragged_block_rows_match_transformers(ragged, path, monkeypatch):
    model_dir, ref = ragged
    spec, ours = _load(model_dir, "cpu-default" if path == "cpu-default" else "experts-fp8")
    assert spec.moe.expert_intermediate_size == 40
    scale = getattr(ours.layers[0], "experts_gate_up_scale", None)
    if path != "cpu-default":  # gate's 3 block rows then up's 3: rows 40..47 take up's first block
        assert scale.shape == (spec.moe.num_experts, 80, 4)
        assert not torch.equal(scale[:, 39], scale[:, 40])
    if path == "triton":
        monkeypatch.setattr(dispatch, "uses_triton", lambda t: True)
    _check_prefill_and_decode(spec, ours, ref)
