"""vLLM's ``kv_cache_dtype`` ``bfloat16`` / ``float16`` (its CacheDType): the cache in that dtype.
loraplex keeps a cache that is not fp8 in the dtype attention computes in, so the value is taken
where it is the model's dtype (then it is ``auto``: the same pages, bytes and tokens) and refused,
naming the model's dtype, before any model is loaded otherwise."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.llm import LLM
from loraplex.sampling_params import SamplingParams
from tests.fixtures.tiny_models import make_tiny_model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_bfloat16_on_a_bfloat16_model_is_auto(tmp_path):
    model = make_tiny_model_dir(tmp_path / "llama", "llama", seed=11)
    prompts = [[5 + (3 * i + j) % 200 for j in range(7 + 2 * i)] for i in range(3)]
    runs = {}
    for name in ("auto", "bfloat16"):
        llm = LLM(model=str(model), dtype="bfloat16", device="cpu", home=tmp_path / name, kv_cache_dtype=name,
                  kv_cache_bytes=1 << 20)
        runner = llm.engine.runner
        assert runner.kv_dtype == torch.bfloat16 and all(c.dtype == torch.bfloat16 for c in runner.kv_caches)
        runs[name] = (runner.num_blocks, runner.kv_bytes_per_token,
                      [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)])
    assert runs["bfloat16"] == runs["auto"]


@pytest.mark.parametrize("kv, dtype", [("bfloat16", "float32"), ("float16", "float32"), ("float16", "bfloat16")])
def test_a_sixteen_bit_cache_other_than_the_model_dtype_is_refused_before_loading(kv, dtype, tmp_path):
    # no model at that path: the refusal comes before the model is looked for
    with pytest.raises(ValueError, match=f"kv_cache_dtype {kv}: the model runs in {dtype}, .*--dtype {kv}"):
        LLM(model=str(tmp_path / "no-such-model"), dtype=dtype, device="cpu", home=tmp_path / "home",
            kv_cache_dtype=kv)


def test_a_sixteen_bit_cache_reads_past_calibrated_kv_scales(tmp_path, caplog):
    """vLLM scales only an fp8 cache: with ``bfloat16`` (the model's dtype) a checkpoint's k_scale /
    v_scale are read past as with auto, so the logprobs are auto's to the bit (K/V stored divided
    by a scale and multiplied back would round twice), and the start-up line says they are unused."""
    import logging

    from tests.model.test_kv_scale_tensors import add_tensors

    model = make_tiny_model_dir(tmp_path / "llama", "llama", seed=11)
    add_tensors(model, {f"model.layers.{i}.self_attn.{n}": torch.tensor(v)
                        for i in range(2) for n, v in (("k_scale", 0.37), ("v_scale", 3.1))})
    prompts = [[5 + (3 * i + j) % 200 for j in range(7 + 2 * i)] for i in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    runs = {}
    for name in ("auto", "bfloat16"):
        with caplog.at_level(logging.INFO, logger="loraplex.model.loader"):
            caplog.clear()
            llm = LLM(model=str(model), dtype="bfloat16", device="cpu", home=tmp_path / name, kv_cache_dtype=name,
                      kv_cache_bytes=1 << 20)
        assert llm.engine.runner.model.kv_scales == [(1.0, 1.0)] * 2
        (line,) = [r for r in caplog.records if "KV-cache scales" in r.getMessage()]
        assert "not used" in line.getMessage() and line.levelno == logging.INFO, line.getMessage()
        runs[name] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
    assert runs["bfloat16"] == runs["auto"]
