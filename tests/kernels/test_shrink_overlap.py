"""The LoRA shrink on a side stream beside the base matmul (``lora.shrink_overlap``), checked on CPU.

CPU has no streams, so recording stand-ins take their place: every call the overlap makes
(waits, switching streams) and every shrink, base matmul and expand are logged with the stream
they were queued on. What is checked is the order a GPU needs (module doc of shrink_overlap):
each shrink on the side stream after it waited for the current one, the base matmul on the
current stream, each expand after the current stream waited for the side one; and that the
outputs are those of the one-stream path, bit for bit (the same Triton kernels, run under the
interpreter, eager steps and graph steps with a stand-in capture). What a real GPU adds (the
capture of a forked stream, any speed-up) is for ``kernels/gpu_check.py``.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from tests.fixtures.peft_adapters import make_peft_adapter

from loraplex.engine.cuda_graphs import DecodeGraphs, eager_capture
from loraplex.kernels import dispatch
from loraplex.lora.shrink_overlap import ShrinkOverlap
from loraplex.model import llama
from loraplex.sampling_params import SamplingParams


class Streams:
    """Two named stand-in streams, the current one, and a log of what was queued where."""

    def __init__(self):
        self.log: list[tuple] = []
        self.main = _Stream("main", self.log)
        self.side = _Stream("side", self.log)
        self.current = self.main

    @contextlib.contextmanager
    def use(self, stream):
        saved, self.current = self.current, stream
        self.log.append(("enter", stream.name))
        try:
            yield
        finally:
            self.current = saved
            self.log.append(("exit", stream.name))

    def overlap(self) -> ShrinkOverlap:
        return ShrinkOverlap(self.side, current=lambda: self.current, use=self.use)

    def logged(self, what: str, fn):
        def call(*args, **kwargs):
            self.log.append((what, self.current.name))
            return fn(*args, **kwargs)

        return call


class _Stream:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other) -> None:
        self.log.append(("wait", self.name, other.name))


# what every projection with a LoRA stack queues, in order
PATTERN = [("wait", "side", "main"), ("enter", "side"), ("shrink", "side"), ("exit", "side"),
           ("linear", "main"), ("wait", "main", "side"), ("expand", "main")]


def test_run_queues_the_shrink_on_the_side_stream_between_the_waits():
    streams = Streams()
    y, shrunk = streams.overlap().run(lambda: streams.log.append(("shrink", streams.current.name)) or "s",
                                      lambda: streams.log.append(("linear", streams.current.name)) or "y")
    assert (y, shrunk) == ("y", "s")
    assert streams.log == [("wait", "side", "main"), ("enter", "side"), ("shrink", "side"), ("exit", "side"),
                           ("linear", "main"), ("wait", "main", "side")]
    assert streams.current is streams.main


@pytest.fixture(scope="module")
def lora_llm(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from loraplex.engine.llm import LLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("overlap-adapters")
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_bytes=4 << 20,
              max_loras=4, max_lora_rank=16, max_num_seqs=8, max_model_len=128)
    llm.add_adapter("all", str(make_peft_adapter(base, root / "all", seed=3, r=8, target_modules="all-linear")))
    llm.add_adapter("qv", str(make_peft_adapter(base, root / "qv", seed=4, r=4)))
    return llm


def _generate(llm):
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16], [17, 18]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, params, adapters=["all", None, "qv", "all"])
    return [(o.outputs[0].token_ids, [sorted(lp.items()) for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_outputs_are_the_one_stream_outputs_and_the_order_holds(lora_llm, graphs, monkeypatch):
    runner = lora_llm.engine.runner
    # the Triton kernels (interpreter) and the model's F.linear path, as on a GPU: the CPU's
    # fused LoRA and prepacked linears have no shrink to move
    monkeypatch.setattr(dispatch, "uses_triton", lambda t: True)
    monkeypatch.setattr(runner.model, "prepacked", None)
    if graphs:
        monkeypatch.setattr(runner, "decode_graphs", DecodeGraphs(
            runner.model, runner.kv_caches, runner.block_size, runner.max_model_len, 8, capture=eager_capture))
    want = _generate(lora_llm)

    streams = Streams()
    monkeypatch.setattr(dispatch, "lora_shrink", streams.logged("shrink", dispatch.lora_shrink))
    monkeypatch.setattr(dispatch, "lora_expand", streams.logged("expand", dispatch.lora_expand))
    functional = types.SimpleNamespace(**{k: getattr(llama.F, k) for k in dir(llama.F) if not k.startswith("__")})
    functional.linear = streams.logged("linear", llama.F.linear)
    monkeypatch.setattr(llama, "F", functional)
    runner.shrink_overlap = streams.overlap()
    if graphs:
        runner.decode_graphs.set_shrink_overlap(runner.shrink_overlap)
    try:
        got = _generate(lora_llm)
    finally:
        runner.shrink_overlap = None
    assert got == want

    log = streams.log
    shrinks = [i for i, event in enumerate(log) if event[0] == "shrink"]
    assert shrinks and len(shrinks) == sum(event[0] == "expand" for event in log)
    for i in shrinks:
        assert log[i - 2 : i + 5] == PATTERN, log[i - 2 : i + 5]
    # nothing else runs on the side stream
    assert sum(event == ("enter", "side") for event in log) == len(shrinks)
    if graphs:
        assert any(key[1] > 0 for key in runner.decode_graphs.graphs)  # the LoRA graph was captured this way


def test_the_option_stays_off_on_cpu(lora_llm, caplog):
    runner = lora_llm.engine.runner
    runner.set_overlap_lora_shrink(True)
    assert runner.shrink_overlap is None
