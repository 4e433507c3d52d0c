"""FP8 MoE models on the CUDA path, checked on CPU: dispatch forced to the Triton kernels (the fused
MoE ones reading fp8 experts, under the interpreter) with the experts kept fp8 as on CUDA. The
decoder's logits equal transformers' on the dequantized weights (fp32) for Qwen3-MoE (16x16 block
scales) and Mixtral (per-tensor scales); decode steps replayed from stand-in captured graphs
generate what the eager CPU engine does on the same checkpoint, and a replay reads nothing back
to the host (so CUDA graphs capture these models too)."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.cuda_graphs import DecodeGraphs, eager_capture
from loraplex.engine.llm import LLM
from loraplex.kernels import dispatch
from loraplex.model import loader
from loraplex.sampling_params import SamplingParams
from tests.fixtures.fp8_checkpoints import write_fp8_pair
from tests.fixtures.tiny_moe import make_tiny_moe_dir
from tests.kernels.test_no_host_sync import trap_host_reads
from tests.model.helpers import chunk_metadata, new_kv_caches, relative_error

BLOCK_SIZE = 16
CASES = {"qwen3_moe": "fp8-block", "mixtral": "ct-tensor"}


def _fp8_pair(tmp_path, family: str, seed: int):
    src = make_tiny_moe_dir(tmp_path / "src", family, seed=seed)
    write_fp8_pair(src, tmp_path / "fp8", tmp_path / "reference", CASES[family])
    return tmp_path / "fp8", tmp_path / "reference"


@pytest.mark.parametrize("family", sorted(CASES))
def test_decoder_on_fp8_triton_kernels_matches_transformers(family, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from loraplex.model.config import ModelSpec
    from loraplex.model.fp8_weights import FP8_DTYPE

    model_dir, ref_dir = _fp8_pair(tmp_path, family, 4)
    spec = ModelSpec.from_dir(model_dir)
    ours = loader.load_model(model_dir, spec, torch.float32, "cpu", max_positions=128, fp8_resident=True)
    ours.prepacked = ours.prepacked_head = None  # the fp8 dense projections run as on CUDA too
    assert ours.layers[0].experts_gate_up.dtype == FP8_DTYPE
    hf = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(9)
    seq_a, seq_b = (torch.randint(4, 300, (n,), generator=gen).tolist() for n in (30, 18))
    steps = [([(0, 20, [3, 6]), (0, 17, [1, 4])], seq_a[:20] + seq_b[:17]),
             ([(20, 10, [3, 6]), (17, 1, [1, 4])], seq_a[20:] + seq_b[17:])]
    calls = []
    fused = dispatch.fused_moe
    monkeypatch.setattr(dispatch, "uses_triton", lambda t: True)
    monkeypatch.setattr(dispatch, "fused_moe", lambda *a: calls.append(a[-1]) or fused(*a))
    kv = new_kv_caches(spec, 8, BLOCK_SIZE)
    got = []
    for chunks, tokens in steps:
        positions, attn = chunk_metadata(chunks, BLOCK_SIZE)
        with torch.no_grad():
            got.append(ours.compute_logits(ours(torch.tensor(tokens), positions, attn, kv)))
    assert len(calls) == 2 * sum(spec.moe.sparse_layers) and all(c is not None for c in calls)  # scales passed
    with torch.no_grad():
        ref_a, ref_b = (hf(torch.tensor([s])).logits[0] for s in (seq_a, seq_b))
    for out, want in zip(got, [torch.cat([ref_a[:20], ref_b[:17]]), torch.cat([ref_a[20:], ref_b[17:]])]):
        assert relative_error(out, want) < 1e-4


PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)
PROMPTS = [[5, 17, 99, 4, 250, 31, 8], [77, 3, 12], [140, 141, 142, 143, 144, 145, 146, 147, 148, 149, 150]]


def make_llm(model_dir, home) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", device="cpu", home=home, kv_cache_bytes=1 << 20,
               max_num_seqs=4, max_model_len=64)


def test_graph_decodes_on_fp8_experts_match_eager_cpu(tmp_path, monkeypatch):
    model_dir, _ = _fp8_pair(tmp_path, "qwen3_moe", 6)
    with monkeypatch.context() as triton:
        triton.setattr(dispatch, "uses_triton", lambda t: True)
        triton.setattr(loader, "experts_stay_fp8", lambda device, fp8_resident: True)
        llm = make_llm(model_dir, tmp_path / "home-graphs")
        runner = llm.engine.runner
        assert runner.model.layers[0].experts_down.dtype == torch.float8_e4m3fn
        runner.decode_graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, runner.max_model_len,
                                            4, eager_capture, layout=runner.kv_layout)
        got = llm.generate(PROMPTS, PARAMS)
        assert sum(g.graph.replays for g in runner.decode_graphs.graphs.values()) >= 3
        with trap_host_reads() as reads, torch.inference_mode():
            for graph in runner.decode_graphs.graphs.values():
                graph.graph.replay()
        assert reads == []
    want = make_llm(model_dir, tmp_path / "home-eager").generate(PROMPTS, PARAMS)  # experts dequantized at load
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want):
        assert [e["logprob"] for e in g.outputs[0].logprobs] == pytest.approx(
            [e["logprob"] for e in w.outputs[0].logprobs], abs=1e-4)
