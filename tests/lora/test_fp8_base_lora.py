"""PEFT adapters served on an FP8 base (compressed-tensors, per-channel scales): greedy outputs of a
mixed batch equal PEFT on transformers' model of the dequantized weights, token for token
(float32), on the CPU prepacked path and on the fp8-resident path that dequantizes per matmul."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex import LLM, SamplingParams
from loraplex.model import llama, loader
from tests.fixtures.fp8_checkpoints import write_fp8_pair
from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.lora.test_acceptance import reference


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-lora")
    src = make_tiny_model_dir(root / "src", "qwen3", seed=6)
    write_fp8_pair(src, root / "fp8", root / "reference", "ct-channel")
    base = AutoModelForCausalLM.from_pretrained(str(root / "reference"), dtype=torch.float32).eval()
    dirs = {
        "all": make_peft_adapter(base, root / "all", seed=21, r=8, target_modules="all-linear"),
        "qv": make_peft_adapter(base, root / "qv", seed=22, r=4, target_modules=["q_proj", "v_proj"]),
    }
    return root, dirs, peft_model_for(base, dirs)


@pytest.mark.parametrize("path", ["prepacked", "dequant-per-matmul", "dequantized-at-load"])
def test_mixed_batch_on_fp8_base_matches_peft_on_dequantized_base(world, path):
    root, dirs, peft_model = world
    with pytest.MonkeyPatch.context() as mp:
        if path != "prepacked":  # no prepacked copies; fp8 resident is what CUDA runs
            mp.setattr(llama, "use_prepacked_linears", lambda device, dtype: False)
            mp.setattr(loader, "fp8_stays_resident", lambda device, dtype: path == "dequant-per-matmul")
        llm = LLM(model=str(root / "fp8"), dtype="float32", device="cpu", home=root / "home",
                  max_loras=2, max_lora_rank=8)
    model = llm.engine.runner.model
    assert (model.prepacked is None) == (path != "prepacked")
    assert (model.layers[0].qkv_weight.dtype == torch.float8_e4m3fn) == (path != "dequantized-at-load")
    prompts = [[5 + (7 * i + j) % 250 for j in range(6 + i)] for i in range(6)]
    which = [None, "all", "qv", "all", None, "qv"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        adapters=[None if w is None else str(dirs[w]) for w in which])
    for prompt, adapter, out in zip(prompts, which, outs):
        assert out.token_ids == reference(peft_model, prompt, adapter)
