"""Expert LoRA on the CUDA path, checked on CPU: dispatch forced to the Triton kernels (under the
interpreter) and decode steps replayed from stand-in captured graphs (``DecodeGraphs`` with
``eager_capture``). A base-only batch first (its graphs hold no expert LoRA and must be
dropped when the first expert adapter arrives), then a mixed batch (base-only, attention-only and
PEFT ``target_parameters`` expert adapters): greedy tokens equal PEFT's own model's, and a
replayed forward reads nothing back to the host."""

from __future__ import annotations

import torch

from loraplex.engine.cuda_graphs import DecodeGraphs, eager_capture
from loraplex.engine.llm import LLM
from loraplex.kernels import dispatch
from loraplex.sampling_params import SamplingParams
from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for
from tests.fixtures.tiny_moe import make_tiny_moe_dir
from tests.kernels.test_no_host_sync import trap_host_reads
from tests.lora.test_acceptance import reference

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPTS = [[5, 17, 99, 4, 250, 31, 8], [77, 3, 12], [140, 141, 142, 143, 144, 145], [9, 8, 7, 6]]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def test_graph_decodes_with_expert_lora_match_peft(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_moe_dir(tmp_path / "qwen3", "qwen3_moe", seed=6)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    dirs = {"experts": make_peft_adapter(base, tmp_path / "experts", seed=3, r=4, target_modules=["q_proj"],
                                         target_parameters=EXPERTS),
            "attn": make_peft_adapter(base, tmp_path / "attn", seed=4, r=2, target_modules=["v_proj"])}
    peft_model = peft_model_for(base, dirs)
    with monkeypatch.context() as triton:
        triton.setattr(dispatch, "uses_triton", lambda t: True)
        llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=tmp_path / "home", kv_cache_bytes=1 << 20,
                  max_num_seqs=4, max_model_len=64, max_loras=2, max_lora_rank=4, enable_expert_lora=True)
        runner = llm.engine.runner
        runner.decode_graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, runner.max_model_len,
                                            4, eager_capture, layout=runner.kv_layout)
        before = [None, "attn", None, "attn"]  # the same bucket and segment class as the mixed batch's
        first = llm.generate(PROMPTS, PARAMS, adapters=[None if w is None else str(dirs[w]) for w in before])
        captured = {k: g for k, g in runner.decode_graphs.graphs.items() if k[1] > 0}  # LoRA graphs
        assert captured and not runner.decode_graphs._expert_lora
        which = [None, "experts", "attn", "experts"]
        got = llm.generate(PROMPTS, PARAMS, adapters=[None if w is None else str(dirs[w]) for w in which])
        assert runner.decode_graphs._expert_lora
        assert set(captured) <= set(runner.decode_graphs.graphs)  # the same keys were used again...
        assert all(runner.decode_graphs.graphs[k] is not g for k, g in captured.items())  # ...recaptured
        assert sum(g.graph.replays for g in runner.decode_graphs.graphs.values()) >= 3
        with trap_host_reads() as reads, torch.inference_mode():
            for graph in runner.decode_graphs.graphs.values():
                graph.graph.replay()
        assert reads == []
    assert [o.token_ids for o in first] == [reference(peft_model, p, w, n=4) for p, w in zip(PROMPTS, before)]
    expected = [reference(peft_model, p, w, n=4) for p, w in zip(PROMPTS, which)]
    assert [o.token_ids for o in got] == expected
    assert expected[1] != reference(peft_model, PROMPTS[1], None, n=4)  # the expert adapter matters
