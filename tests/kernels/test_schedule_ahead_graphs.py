"""``schedule_ahead`` through the CUDA-graph decode path, on CPU: the Triton kernels under the
interpreter, a stand-in capture that replays the forward eagerly on the same static buffers. A
step launched ahead takes its input tokens from the step before on the device, copied into the
graph's input buffer after the staged host inputs; greedy outputs (penalties, a seeded draw,
a grammar and bad words among them) and logprobs must be those of the engine that waits
(tests/engine/test_schedule_ahead.py holds the eager path and the fake runner's exhaustive
comparison)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.fixtures.peft_adapters import make_peft_adapter

from loraplex.engine.cuda_graphs import DecodeGraphs, eager_capture
from loraplex.kernels import dispatch
from loraplex.sampling_params import SamplingParams
from loraplex.structured_output import StructuredOutputs
from tests.fixtures.tiny_models import VOCAB_SIZE


@pytest.mark.slow
def test_graph_steps_launched_ahead_give_the_outputs_of_the_engine_that_waits(tiny_llama_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from loraplex.engine.llm import LLM

    monkeypatch.setattr(dispatch, "uses_triton", lambda t: True)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    adapter = make_peft_adapter(base, tmp_path / "a", seed=5, r=8, target_modules="all-linear")
    rng = random.Random(11)
    prompts = [[rng.randrange(4, 250) for _ in range(rng.randrange(2, 7))] for _ in range(5)]
    which = ["a", None, "a", None, "a"]
    # penalties and a seeded draw count the token the step before is still drawing (its graph's output)
    steer = [dict(presence_penalty=2.0), {}, dict(frequency_penalty=1.5), dict(repetition_penalty=1.5),
             dict(temperature=0.9, seed=3)]
    params = [SamplingParams(ignore_eos=True, max_tokens=n, logprobs=1, **{"temperature": 0.0, **extra})
              for n, extra in zip((5, 3, 6, 6, 4), steer)]
    # a grammar row (its draw waits for the step before: DeferredDraw) and bad words read on the device
    prompts += [prompts[1], prompts[3]]
    which += [None, "a"]
    params += [SamplingParams(temperature=0.0, max_tokens=6, logprobs=1,
                              structured_outputs=StructuredOutputs(regex="[a-c]{2}-[0-9]{3}")),
               SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=5, logprobs=1,
                              bad_words_token_ids=[[t, t] for t in range(VOCAB_SIZE)])]
    results = []
    for ahead in (False, True):
        llm = LLM(model=str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_bytes=4 << 20, max_loras=2,
                  max_lora_rank=8, max_num_seqs=8, max_model_len=64, schedule_ahead=ahead)
        llm.add_adapter("a", str(adapter))
        runner = llm.engine.runner
        runner.decode_graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, runner.max_model_len,
                                            8, capture=eager_capture, layout=runner.kv_layout)
        run_graph, graph_ahead = runner.decode_graphs.run, []

        def counting_run(inputs, token_slots, pool, fill_pending=None, run_graph=run_graph, graph_ahead=graph_ahead):
            graph_ahead.append(fill_pending is not None)
            return run_graph(inputs, token_slots, pool, fill_pending)

        runner.decode_graphs.run = counting_run
        outs = llm.generate(prompts, params, adapters=which)
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
        assert graph_ahead and (sum(graph_ahead) > 0) == ahead
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    sync, ahead = results
    assert len(sync[5][0]) == 6 and all(a != b for a, b in zip(sync[6][0], sync[6][0][1:]))
    for (w_tokens, w_lps), (g_tokens, g_lps) in zip(sync, ahead):
        assert g_tokens == w_tokens
        # the graph's bucket pads both alike, so the same rows compute the same numbers
        assert [lp["logprob"] for lp in g_lps] == pytest.approx([lp["logprob"] for lp in w_lps], abs=1e-5)
