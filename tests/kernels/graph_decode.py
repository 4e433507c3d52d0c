"""The end-to-end check shared by the model families' Triton tests: an LLM on CPU whose decode
steps replay eagerly captured "graphs" through the Triton kernels (interpreter), with PEFT
adapters, against PEFT's own greedy tokens."""

from __future__ import annotations

from loraplex.engine.cuda_graphs import DecodeGraphs, eager_capture
from loraplex.engine.llm import LLM
from loraplex.sampling_params import SamplingParams
from tests.fixtures.peft_adapters import peft_model_for
from tests.lora.test_acceptance import reference


def check_graph_decodes_match_peft(model_dir, hf, adapters: dict, prompts: list[list[int]], which: list,
                                   home, max_model_len: int = 128, max_tokens: int = 5) -> None:
    """Generate ``prompts`` (adapter ``which[i]``, None = base) greedily; the tokens must equal
    PEFT's, and the decodes must have run as graph replays with the LoRA kernels."""
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=home, kv_cache_bytes=1 << 20,
              max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=max_model_len)
    for name, path in adapters.items():
        llm.add_adapter(name, str(path))
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, runner.max_model_len, 4, eager_capture,
                          layout=runner.kv_layout)
    runner.decode_graphs = graphs
    peft_model = peft_model_for(hf, adapters)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, adapters=which)
    assert [o.token_ids for o in outs] == [reference(peft_model, p, a, max_tokens) for p, a in zip(prompts, which)]
    assert sum(g.graph.replays for g in graphs.graphs.values()) >= 3  # the decodes ran as graphs
    assert any(seg_class > 0 for _, seg_class in graphs.graphs)  # with the LoRA kernels
