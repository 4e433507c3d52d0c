"""An fp8 KV cache on the CUDA path, checked on CPU: the Triton write and attention kernels
(interpreter, dispatch forced to them) inside decode steps replayed from stand-in captured graphs
(``cuda_graphs.DecodeGraphs`` with ``eager_capture``) generate what the eager CPU engine does when
its model's-dtype cache is written with K/V rounded through fp8 by torch's cast (with a checkpoint's
calibrated KV-cache scales too: x / scale rounded, times the scale); the replayed
forward, the fp8 write included, reads nothing back to the host."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.engine.cuda_graphs import DecodeGraphs, eager_capture
from loraplex.engine.llm import LLM
from loraplex.kernels import dispatch
from loraplex.sampling_params import SamplingParams
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.kernels.test_no_host_sync import trap_host_reads

PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)
PROMPTS = [[5, 17, 99, 4, 250, 31, 8], [77, 3, 12], [140, 141, 142, 143, 144, 145, 146, 147, 148, 149, 150, 151,
                                                     152, 153, 154, 155, 156, 157, 158]]


def make_llm(model_dir, home, kv_cache_dtype: str) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", device="cpu", home=home, kv_cache_bytes=1 << 20,
               max_num_seqs=4, max_model_len=64, kv_cache_dtype=kv_cache_dtype)


@pytest.fixture(scope="module")
def scaled_llama_dir(tmp_path_factory):
    """The tiny Llama with calibrated KV-cache scales ``SCALES`` on both layers."""
    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("llama-kv-scales"), "llama")
    (weights,) = model_dir.glob("*.safetensors")
    save_file({**load_file(weights), **{f"model.layers.{i}.self_attn.{n}": torch.tensor(v) for i in range(2)
                                        for n, v in zip(("k_scale", "v_scale"), SCALES)}},
              weights, metadata={"format": "pt"})
    return model_dir


SCALES = tuple(float(torch.tensor(s)) for s in (0.0071, 0.0123))  # as the checkpoint stores them (fp32)


@pytest.mark.parametrize("scaled", [False, True], ids=["scale1", "calibrated"])
@pytest.mark.parametrize("kind,fp8,limit", [("fp8", torch.float8_e4m3fn, 448.0),
                                            ("fp8_e5m2", torch.float8_e5m2, 57344.0)])
def test_graph_decodes_over_fp8_cache_match_rounded_kv(tiny_llama_dir, scaled_llama_dir, loraplex_home, monkeypatch,
                                                       kind, fp8, limit, scaled):
    """With calibrated scales (``scaled``) the reference's writes are rounded as vLLM's scaled
    write does: x / scale through fp8, times the scale."""
    model_dir = scaled_llama_dir if scaled else tiny_llama_dir
    k_scale, v_scale = SCALES if scaled else (1.0, 1.0)
    write = dispatch.write_kv_cache
    with monkeypatch.context() as triton:
        triton.setattr(dispatch, "uses_triton", lambda t: True)
        llm = make_llm(model_dir, loraplex_home, kind)
        runner = llm.engine.runner
        assert runner.kv_storage[0].dtype == fp8
        runner.decode_graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, runner.max_model_len,
                                            4, eager_capture, layout=runner.kv_layout)
        got = llm.generate(PROMPTS, PARAMS)
        assert sum(g.graph.replays for g in runner.decode_graphs.graphs.values()) >= 3
        with trap_host_reads() as reads, torch.inference_mode():  # the fp8 write is capturable too
            for graph in runner.decode_graphs.graphs.values():
                graph.graph.replay()
        assert reads == []

    def rounded(x, scale):
        return ((x.float() / scale).clamp(-limit, limit).to(fp8).float() * scale).to(x.dtype)

    monkeypatch.setattr(dispatch, "write_kv_cache", lambda k, v, cache, slots, *scales: write(
        rounded(k, k_scale), rounded(v, v_scale), cache, slots, *scales))
    want = make_llm(model_dir, loraplex_home, "auto").generate(PROMPTS, PARAMS)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want):
        assert [e["logprob"] for e in g.outputs[0].logprobs] == pytest.approx(
            [e["logprob"] for e in w.outputs[0].logprobs], abs=1e-4)
