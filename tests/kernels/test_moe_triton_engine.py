"""MoE models on the CUDA path, checked on CPU: dispatch forced to the Triton kernels (the fused
MoE ones included, under the interpreter). The decoder's logits equal transformers' own model
and the CPU path's, for Mixtral, Qwen3-MoE and Qwen2-MoE; then decode steps replayed from
stand-in captured graphs (``cuda_graphs.DecodeGraphs`` with ``eager_capture``) generate what the
eager CPU engine does, and a replayed forward reads nothing back to the host, which is what lets
the engine capture CUDA graphs for these models."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.cuda_graphs import DecodeGraphs, eager_capture
from loraplex.engine.llm import LLM
from loraplex.kernels import dispatch
from loraplex.sampling_params import SamplingParams
from tests.fixtures.tiny_moe import make_tiny_moe_dir
from tests.kernels.test_no_host_sync import trap_host_reads
from tests.model.helpers import chunk_metadata, new_kv_caches, relative_error

BLOCK_SIZE = 16


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_decoder_on_triton_kernels_matches_transformers_and_cpu_path(family, tmp_path, monkeypatch):
    """A prefill of two sequences, then a step of a chunk beside a one-token decode."""
    from transformers import AutoModelForCausalLM

    from loraplex.model.config import ModelSpec
    from loraplex.model.loader import load_model

    model_dir = make_tiny_moe_dir(tmp_path / family, family, "fused", seed=4)
    spec = ModelSpec.from_dir(model_dir)
    ours = load_model(model_dir, spec, torch.float32, "cpu", max_positions=128)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(9)
    seq_a, seq_b = (torch.randint(4, 300, (n,), generator=gen).tolist() for n in (30, 18))
    steps = [([(0, 20, [3, 6]), (0, 17, [1, 4])], seq_a[:20] + seq_b[:17]),
             ([(20, 10, [3, 6]), (17, 1, [1, 4])], seq_a[20:] + seq_b[17:])]

    def run(triton: bool) -> list[torch.Tensor]:
        with monkeypatch.context() as patch:
            if triton:
                patch.setattr(dispatch, "uses_triton", lambda t: True)
            kv = new_kv_caches(spec, 8, BLOCK_SIZE)
            out = []
            for chunks, tokens in steps:
                positions, attn = chunk_metadata(chunks, BLOCK_SIZE)
                out.append(ours.compute_logits(ours(torch.tensor(tokens), positions, attn, kv)))
            return out

    calls = []
    fused = dispatch.fused_moe
    monkeypatch.setattr(dispatch, "fused_moe", lambda *a: calls.append(a[0].shape) or fused(*a))
    on_triton, on_cpu = run(True), run(False)
    assert len(calls) == 2 * 2 * sum(spec.moe.sparse_layers)  # every sparse layer, both paths, both steps
    with torch.no_grad():
        ref_a, ref_b = (hf(torch.tensor([s])).logits[0] for s in (seq_a, seq_b))
    want = [torch.cat([ref_a[:20], ref_b[:17]]), torch.cat([ref_a[20:], ref_b[17:]])]
    for got, cpu, ref in zip(on_triton, on_cpu, want):
        assert relative_error(got, ref) < 1e-4
        assert relative_error(got, cpu) < 1e-5


PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)
PROMPTS = [[5, 17, 99, 4, 250, 31, 8], [77, 3, 12], [140, 141, 142, 143, 144, 145, 146, 147, 148, 149, 150]]


def make_llm(model_dir, home) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", device="cpu", home=home, kv_cache_bytes=1 << 20,
               max_num_seqs=4, max_model_len=64)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_graph_decodes_on_fused_moe_match_eager_cpu(family, tmp_path, monkeypatch):
    model_dir = make_tiny_moe_dir(tmp_path / family, family, seed=6)
    with monkeypatch.context() as triton:
        triton.setattr(dispatch, "uses_triton", lambda t: True)
        llm = make_llm(model_dir, tmp_path / "home-graphs")
        runner = llm.engine.runner
        runner.decode_graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, runner.max_model_len,
                                            4, eager_capture, layout=runner.kv_layout)
        got = llm.generate(PROMPTS, PARAMS)
        assert sum(g.graph.replays for g in runner.decode_graphs.graphs.values()) >= 3
        with trap_host_reads() as reads, torch.inference_mode():  # routing, alignment, both kernels
            for graph in runner.decode_graphs.graphs.values():
                graph.graph.replay()
        assert reads == []
    want = make_llm(model_dir, tmp_path / "home-eager").generate(PROMPTS, PARAMS)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want):
        assert [e["logprob"] for e in g.outputs[0].logprobs] == pytest.approx(
            [e["logprob"] for e in w.outputs[0].logprobs], abs=1e-4)
