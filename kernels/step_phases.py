"""Where a decode step's time goes (part of the end-to-end check): the engine's phases timed on
the host, per step replayed from a CUDA graph, for the base model and with adapters; and one
captured step replayed under the profiler, its device time by kernel group.

The 2026-12-04 H200 calls measured the same code at +23% and +95% LoRA step overhead (graph
steps of 5.24 and 8.24 ms against 4.25 for the base): the kernel timings could not explain the
difference, so this splits the step. Nothing here changes the engine: its methods are wrapped on
the instances (``PendingRun.result`` on its class) for one generate call and unwrapped after. The
wait for the GPU shows in the phase that reads the sampled tokens back.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# (label, how to find the object on the LLM, method name), in the order a step runs them (with
# overlap_outputs, on a GPU, the previous step's outputs are made between the sampler's launch and
# the wait for this step's tokens; without it, after the scheduler update)
PHASES: list[tuple[str, Callable, str]] = [
    ("schedule", lambda llm: llm.engine.scheduler, "schedule"),
    # schedule_ahead: the next step, scheduled before this one's tokens are read back
    ("schedule ahead", lambda llm: llm.engine.scheduler, "schedule_ahead"),
    ("adapter placement", lambda llm: llm.engine.runner.lora_manager, "place"),
    ("adapter slots", lambda llm: llm.engine.runner.lora_manager, "step_slots"),
    ("decode inputs: copy to graph buffers", lambda llm: llm.engine.runner.decode_graphs, "_fill_inputs"),
    ("LoRA metadata: copy to graph buffers", lambda llm: llm.engine.runner.decode_graphs, "_fill_lora"),
    ("graph run (fill + replay launch)", lambda llm: llm.engine.runner.decode_graphs, "run"),
    ("lm_head (launch)", lambda llm: llm.engine.runner.model, "compute_logits"),
    ("sampler (launch)", lambda llm: llm.engine.runner.sampler, "launch"),
    ("outputs (detokenizing, output objects)", lambda llm: llm.engine, "_outputs_of"),
    ("tokens read back (waits for the GPU)", lambda llm: _pending_run_class(), "result"),
    ("scheduler update", lambda llm: llm.engine.scheduler, "update"),
]
# phases timed inside another phase ("graph run" makes the two copies)
NESTED = {"decode inputs: copy to graph buffers", "LoRA metadata: copy to graph buffers"}
REST = "rest of the step (the rest of execute and of the engine's step)"


def _pending_run_class():
    from loraplex.engine.model_runner import PendingRun

    return PendingRun  # its ``result`` is wrapped on the class (a new instance each step)


class StepPhases:
    """Host seconds per phase of each engine step, while installed on an LLM."""

    def __init__(self, llm):
        self.llm = llm
        self.steps: list[dict[str, float]] = []  # one per engine step; "graph" marks graph steps
        self._current: dict[str, float] | None = None
        self._wrapped: list[tuple[object, str, object]] = []  # (object, name, its own attribute or None)

    def __enter__(self) -> "StepPhases":
        for label, find, name in PHASES:
            obj = find(self.llm)
            if obj is not None:
                self._wrap(obj, name, label)
        runner = self.llm.engine.runner
        self._wrap(runner, "_execute_graph", "graph")  # marks the steps a graph ran
        self._wrap(self.llm.engine, "step", "step")
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, own in reversed(self._wrapped):
            if own is None:
                delattr(obj, name)  # the class's method is back
            else:
                setattr(obj, name, own)  # its own attribute: a function on a class (PendingRun.result)
        self._wrapped.clear()

    def _wrap(self, obj, name: str, label: str) -> None:
        original = getattr(obj, name)

        def timed(*args, **kwargs):
            if label == "step":
                self._current = {}
            t0 = time.perf_counter()
            try:
                result = original(*args, **kwargs)
                if label in ("schedule", "schedule ahead") and result is not None and self._current is not None:
                    # sequences of a step that runs one token for each (0: any prefill in it)
                    one_each = result.num_batched_tokens == len(result.scheduled)
                    self._current["decode_seqs"] = len(result.scheduled) if one_each else 0
                return result
            finally:
                spent = time.perf_counter() - t0
                if self._current is not None:
                    self._current[label] = self._current.get(label, 0.0) + spent
                if label == "step":
                    self.steps.append(self._current)
                    self._current = None

        self._wrapped.append((obj, name, vars(obj).get(name)))
        setattr(obj, name, timed)

    def decode_step_seconds(self, num_seqs: int) -> list[float]:
        """Host seconds of each whole step that ran one token for each of ``num_seqs`` sequences."""
        return [s["step"] for s in self.steps if s.get("decode_seqs") == num_seqs]

    def per_graph_step_ms(self) -> dict[str, float]:
        """Mean milliseconds per graph-replayed step, per phase (and "step": the whole step)."""
        graph_steps = [s for s in self.steps if "graph" in s]
        if not graph_steps:
            return {}
        labels = ["step"] + [label for label, _, _ in PHASES]
        ms = {label: sum(s.get(label, 0.0) for s in graph_steps) / len(graph_steps) * 1e3 for label in labels}
        # what no phase covers: about 1.5 ms of call 4's base step, 0.18 ms more with adapters
        ms[REST] = ms["step"] - sum(v for label, v in ms.items() if label != "step" and label not in NESTED)
        return ms


# kernel-name fragments (lower case) of each group of a replayed decode step's device time
KERNEL_GROUPS: list[tuple[str, tuple[str, ...]]] = [
    ("LoRA (shrink, partial sums, expand)", ("sgmv", "sum_partials")),
    ("attention and KV write", ("paged_attention", "merge_kv", "write_kv")),
    ("matmuls", ("gemm", "cutlass", "nvjet", "xmma", "aten::mm", "aten::addmm", "aten::linear", "aten::matmul",
                 "linear_pointwise")),
]


def replay_device_us(graph, on_gpu: bool, replays: int = 5) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Microseconds per replay of one captured decode step, by kernel group (``KERNEL_GROUPS``,
    the rest as "other"), and the largest kernels by name, from the profiler's device time (on
    CPU, where the stand-in capture runs the forward eagerly, the CPU time of the ops: it
    exercises this code, no GPU figure)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():  # as the engine replays (the CPU stand-in runs the forward)
        graph.replay()  # warm
        if on_gpu:
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
            for _ in range(replays):
                graph.replay()
            if on_gpu:
                torch.cuda.synchronize()
    totals = {name: 0.0 for name, _ in KERNEL_GROUPS} | {"other": 0.0}
    by_name = []
    for event in prof.key_averages():
        if on_gpu:
            spent = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)
        else:
            spent = event.self_cpu_time_total
        if spent <= 0:
            continue
        key = event.key.lower()
        group = next((name for name, parts in KERNEL_GROUPS if any(p in key for p in parts)), "other")
        totals[group] += spent / replays
        by_name.append((event.key, spent / replays))
    totals["total"] = sum(totals.values())
    return totals, sorted(by_name, key=lambda kv: -kv[1])[:6]
