"""End-to-end part of the GPU check: loraplex's engine on a random-weight Llama with Llama-3-8B
layer shapes (fewer layers; nothing downloaded), decode throughput and LoRA overhead.

The model directory (config, bf16 safetensors, a byte-level tokenizer) and the rank-16 adapters
(real PEFT directories written by peft, ``init_lora_weights=False``) are made on the fly. Each
configuration is run after a warm-up; its decode step is the median host time of the engine steps
that ran one token for every sequence of the batch, over two runs (the overhead and the target
use it). Beside it, as calls 1-3 of 2026-12-04 measured it, the difference of whole-run times
with two generation lengths (best of two each): ``(t_long - t_short) / (long - short)``. That
difference swung by up to 30% between calls and between rows of one call (call 5: the base graph
step above its eager step, a LoRA step 26% under its base), while the median step of the same
configurations agreed within a few percent (the step-phase table of calls 4 and 5).

Every configuration runs eagerly and then with decode steps replayed from CUDA graphs
(``cuda_graphs=True``; the same engine, its ``decode_graphs`` switched off for the eager rows).
A failure of the graph path is reported and ends the graph rows; the eager rows go on. The
greedy tokens of the two modes are compared (bf16 kernels with other grids may flip a near tie).
The CPU smoke run (float32, tiny shapes) runs the graph rows of the batch-4 configurations
through the Triton interpreter with an eager stand-in for the capture, so this code path is
exercised before a GPU ever runs it.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import tempfile
import time
from pathlib import Path

import torch
from lab_common import Report, run_section

LLAMA3_8B_LAYER = dict(
    hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
)
TINY_LAYER = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=320, rope_theta=10000.0, max_position_embeddings=1024,
)
TARGET_SETS = {
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qkvo": ["q_proj", "k_proj", "v_proj", "o_proj"],
}
OVERHEAD_TARGET = 0.15  # LoRA step overhead at 64 distinct rank-16 adapters, batch 256


def _make_model_and_adapters(
    root: Path, shape: dict, layers: int, num_adapters: int, targets: list[str], device: str
) -> tuple[Path, list[Path]]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.fixtures.tiny_models import make_tiny_tokenizer  # the project's byte-level tokenizer

    shape = dict(shape)
    rope_theta = shape.pop("rope_theta")
    config = LlamaConfig(num_hidden_layers=layers, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
                         pad_token_id=2, rms_norm_eps=1e-5, **shape)
    config.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model_dir = root / "model"
    model.save_pretrained(model_dir)
    make_tiny_tokenizer(config.vocab_size).save_pretrained(model_dir)
    peft_model = get_peft_model(
        model, LoraConfig(r=16, lora_alpha=32, target_modules=targets, init_lora_weights=False)
    )
    adapter_dirs = []
    with torch.no_grad():
        for i in range(num_adapters):
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, 0.02)
            out = root / f"adapter-{i:03d}"
            peft_model.save_pretrained(out)
            adapter_dirs.append(out)
    del model, peft_model
    if device == "cuda":
        torch.cuda.empty_cache()
    return model_dir, adapter_dirs


def _timed_generate(llm, prompts, adapters, max_tokens: int) -> tuple[float, list[list[int]]]:
    from loraplex import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, adapters=adapters)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    if got != max_tokens * len(prompts):
        raise RuntimeError(f"expected {max_tokens * len(prompts)} generated tokens, got {got}")
    return elapsed, [list(o.outputs[0].token_ids) for o in outs]


def run_e2e(
    report: Report, on_gpu: bool, layers: int, max_tokens: int, prompt_len: int, targets: str, deadline: float,
    host_miss: bool = True,
) -> None:
    """Run the configurations in order; none is started after ``deadline`` (``time.time()``)."""
    from loraplex import LLM

    device = "cuda" if on_gpu else "cpu"
    shape = LLAMA3_8B_LAYER if on_gpu else TINY_LAYER
    if on_gpu:
        # the target configuration first, so a run cut short by the budget still has it
        configs = [(256, 0), (256, 64), (64, 0), (64, 16), (64, 128), (256, 16), (256, 128)]
    else:
        configs, layers, max_tokens, prompt_len = [(4, 0), (4, 2), (8, 0), (8, 4)], 2, 6, 8
    short = max(2, max_tokens // 4)
    num_adapters = max(n for _, n in configs)
    report.line(f"## End to end ({'Llama-3-8B layer shapes' if on_gpu else 'tiny shapes'}, {layers} layers, "
                f"vocab {shape['vocab_size']}, {'bf16' if on_gpu else 'fp32'}, prompt {prompt_len} tokens, "
                f"rank-16 adapters on {targets} modules ({', '.join(TARGET_SETS[targets])}), greedy, ignore_eos)")
    report.line()
    if time.time() > deadline:
        # the model and 128 adapters take tens of seconds to write, and no configuration would run
        report.line("time budget spent before the end-to-end part: not run (raise --budget-s, or run it alone "
                    "with --skip-bench)")
        report.line()
        return
    with tempfile.TemporaryDirectory(prefix="loraplex-e2e-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        model_dir, adapter_dirs = _make_model_and_adapters(
            root, shape, layers, num_adapters, TARGET_SETS[targets], device
        )
        report.line(f"model + {num_adapters} PEFT adapters written in {time.perf_counter() - t0:.0f} s")
        t0 = time.perf_counter()
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()  # the engine's peak, not the model writer's or the benches'
        llm = LLM(
            # the CPU smoke's graph rows run Triton under the interpreter, whose bf16 dot is wrong
            model=str(model_dir), dtype="bfloat16" if on_gpu else "float32", device=device, home=root / "home",
            max_loras=num_adapters, max_lora_rank=16, max_num_seqs=256,
            max_num_batched_tokens=8192, max_model_len=prompt_len + max_tokens + 16,
            # every configuration reruns its prompts: cached prompt blocks would hide the prefill
            # in "tokens/s (whole run)"; the LoRA overhead is about computing, so compute it all
            enable_prefix_caching=False,
            cuda_graphs=on_gpu,
        )
        runner = llm.engine.runner
        graphs = runner.decode_graphs
        if not on_gpu:
            from loraplex.engine.cuda_graphs import DecodeGraphs, eager_capture

            graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, runner.max_model_len,
                                  llm.engine.config.max_num_seqs, capture=eager_capture, layout=runner.kv_layout)
        names = [f"a{i:03d}" for i in range(num_adapters)]
        for name, path in zip(names, adapter_dirs):
            llm.add_adapter(name, str(path))
        report.line(f"engine up and adapters registered in {time.perf_counter() - t0:.0f} s")
        # as `loraplex serve` does once it is up (server/cli.py freeze_startup_objects): the start-up
        # heap (torch, Triton, transformers, the model) leaves the collections, so a full collection
        # scans only what the runs create; without it, one every hundred steps or so scanned it all
        gc.collect()
        gc.freeze()
        gen = torch.Generator().manual_seed(1234)
        results, results_by_totals, rows, repeats, inputs = {}, {}, [], {}, {}
        modes = ["eager"] + (["graphs"] if graphs is not None else [])
        for batch, n_adapters in configs:
            prompts = torch.randint(4, shape["vocab_size"], (batch, prompt_len), generator=gen).tolist()
            adapters = [names[i % n_adapters] if n_adapters else None for i in range(batch)]
            inputs[(batch, n_adapters)] = (prompts, adapters)
            for mode in list(modes):
                if mode == "graphs" and not on_gpu and batch > 4:
                    continue  # the interpreter is slow: the smoke run's graph rows are batch 4 only
                if time.time() > deadline:
                    report.line(f"time budget spent: batch {batch} with {n_adapters} adapters ({mode}) and later not run")
                    break
                runner.decode_graphs = graphs if mode == "graphs" else None
                try:
                    with _triton_on_cpu(mode == "graphs" and not on_gpu):
                        step, step_by_totals, t_long, outs = _measure(llm, prompts, adapters, short, max_tokens)
                except Exception as exc:  # noqa: BLE001 - the graph path has never run before
                    if mode != "graphs":
                        raise
                    report.line(f"CUDA-graph run FAILED at batch {batch}, {n_adapters} adapters: {exc!r}")
                    report.failures.append("CUDA-graph decode raised")
                    modes.remove("graphs")
                    continue
                repeats[(batch, n_adapters, mode)] = outs
                results[(batch, n_adapters, mode)] = step
                results_by_totals[(batch, n_adapters, mode)] = step_by_totals
                overhead = _overhead(results, batch, n_adapters, mode)
                overhead_by_totals = _overhead(results_by_totals, batch, n_adapters, mode)
                rows.append([batch, n_adapters, mode, f"{batch * max_tokens / t_long:.0f}", f"{step * 1e3:.2f}",
                             f"{batch / step:.0f}", overhead, f"{step_by_totals * 1e3:.2f}", overhead_by_totals])
                # into results.md at once: a device call cut short by its time limit keeps the rows it measured
                report.line(f"- measured: batch {batch}, {n_adapters} adapters, {mode}: decode step {step * 1e3:.2f} ms "
                            f"median (LoRA overhead {overhead}), {step_by_totals * 1e3:.2f} ms by run totals "
                            f"({overhead_by_totals})")
                report.write()
        runner.decode_graphs = graphs
        report.line()
        report.table(["batch", "distinct adapters", "decode", "tokens/s (whole run)", "decode step ms (median)",
                      "decode tokens/s", "LoRA overhead vs base", "decode step ms (run totals)",
                      "LoRA overhead (run totals)"], rows)
        # the base and the target configuration (on CPU the batch-4 ones), split into host phases
        phase_cases = {c: inputs[c] for c in ([(256, 0), (256, 64)] if on_gpu else [(4, 0), (4, 2)])
                       if (*c, "graphs") in results}
        # first the engine options (the target's overhead with schedule_ahead and the shrink
        # beside), then where a step's host time goes: a budget cut keeps the first
        # (each in its own section: the agreement lines, memory and host misses below still run)
        if len(phase_cases) == 2 and time.time() < deadline:
            run_section(report, "engine options", _report_engine_options, report, llm, phase_cases, on_gpu, max_tokens)
        if len(phase_cases) == 2 and time.time() < deadline:
            run_section(report, "step phases", _report_step_phases, report, llm, phase_cases, on_gpu, max_tokens)
        for (batch, n_adapters, mode), (outs, _) in repeats.items():
            if mode == "graphs" and (batch, n_adapters, "eager") in repeats:
                eager = repeats[(batch, n_adapters, "eager")][0]
                report.line(f"- batch {batch}, {n_adapters} adapters: graph and eager greedy tokens identical "
                            f"for {_agreement(outs, eager)}")
        # the same mode run twice: the same tokens unless something adds in no fixed order (the
        # shrink's split-K fp32 atomics did until 2026-12-04: 69 of 256 sequences alike)
        for (batch, n_adapters, mode), (first, second) in repeats.items():
            report.line(f"- batch {batch}, {n_adapters} adapters, {mode} run twice: identical for "
                        f"{_agreement(first, second)}")
        report.line()
        _report_memory(report, llm, on_gpu)
        del llm, runner, graphs
        gc.unfreeze()  # the engine's objects may be collected now
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()  # the host-miss engines size their own KV caches
        if host_miss:
            from host_miss_bench import run_host_miss

            run_host_miss(report, on_gpu, model_dir, adapter_dirs[:8], prompt_len, root, deadline)
    for mode in ("eager", "graphs"):
        if on_gpu and (256, 64, mode) in results and (256, 0, mode) in results:
            overhead = results[(256, 64, mode)] / results[(256, 0, mode)] - 1
            ok = overhead <= OVERHEAD_TARGET
            report.target(f"{'MET' if ok else 'MISSED'} LoRA step overhead ({mode}) at batch 256, 64 distinct rank-16 "
                          f"adapters: {overhead * 100:+.1f}% (target <= {OVERHEAD_TARGET * 100:.0f}%)")


def _report_step_phases(report: Report, llm, cases: dict, on_gpu: bool, max_tokens: int) -> None:
    """One more run of each case with the engine's phases timed on the host (step_phases.py),
    then one with overlap_outputs the other way (between two generate calls nothing is deferred,
    so the switch is safe), side by side."""
    from step_phases import StepPhases, replay_device_us

    from loraplex.engine.cuda_graphs import segment_class

    columns, medians, tokens, device, largest = {}, {}, {}, {}, {}
    graphs = llm.engine.runner.decode_graphs
    engine = llm.engine
    overlap = engine.overlap_outputs

    def timed_run(batch: int, n_adapters: int, prompts, adapters) -> None:
        with _triton_on_cpu(not on_gpu), StepPhases(llm) as phases:
            _, tokens[(batch, n_adapters, engine.overlap_outputs)] = _timed_generate(llm, prompts, adapters, max_tokens)
        columns[(batch, n_adapters, engine.overlap_outputs)] = phases.per_graph_step_ms()
        steps = phases.decode_step_seconds(batch)
        medians[(batch, n_adapters, engine.overlap_outputs)] = statistics.median(steps) * 1e3 if steps else float("nan")

    for (batch, n_adapters), (prompts, adapters) in cases.items():
        timed_run(batch, n_adapters, prompts, adapters)
        # the last step's graph, replayed on its buffers (every request has ended: the KV slots
        # it writes belong to no one), its device time by kernel group
        seg_class = segment_class(batch, -(-batch // n_adapters)) if n_adapters else 0
        graph = graphs.graphs.get((graphs.bucket_for(batch), seg_class))
        if graph is not None:
            try:
                with _triton_on_cpu(not on_gpu):
                    device[(batch, n_adapters)], largest[(batch, n_adapters)] = replay_device_us(graph.graph, on_gpu)
            except Exception as exc:  # noqa: BLE001 - the profiler must not cost the rows that follow
                report.line(f"profiling the batch {batch}, {n_adapters} adapters graph failed: {exc!r}")
    engine.overlap_outputs = not overlap
    try:
        for (batch, n_adapters), (prompts, adapters) in cases.items():
            timed_run(batch, n_adapters, prompts, adapters)
    finally:
        engine.overlap_outputs = overlap
    for batch, n_adapters in cases:
        on, off = (batch, n_adapters, True), (batch, n_adapters, False)
        report.line(f"- batch {batch}, {n_adapters} adapters: decode step median {medians[on]:.3f} ms with "
                    f"overlap_outputs, {medians[off]:.3f} ms without ({medians[on] / medians[off] - 1:+.1%}); "
                    f"greedy tokens identical for {_agreement(tokens[on], tokens[off])}")
    report.line()
    labels = list(next(iter(columns.values())))
    report.line("Host milliseconds per graph-replayed decode step, by phase (mean over one run's graph steps; "
                "\"graph run\" includes the two copies to graph buffers; the tokens' read-back waits for the GPU; "
                "overlapped: the previous step's outputs are made while the GPU runs this one, else after the "
                "scheduler update):")
    report.line()
    rows = [[label] + [f"{col.get(label, 0.0):.3f}" for col in columns.values()] for label in labels]
    report.table(["phase"] + [f"batch {b}, {n} adapters{', overlapped' if o else ''}" for b, n, o in columns], rows)
    if len(device) == len(cases):
        kind = "device" if on_gpu else "CPU (stand-in capture: no GPU figure)"
        report.line(f"{kind} microseconds per replay of the step's CUDA graph, by kernel group (profiler, 5 replays):")
        report.line()
        groups = list(next(iter(device.values())))
        rows = [[g] + [f"{col[g]:.1f}" for col in device.values()] for g in groups]
        report.table(["kernels"] + [f"batch {b}, {n} adapters" for b, n in device], rows)
        for (batch, n_adapters), top in largest.items():
            names = "; ".join(f"{name[:60]} {us:.1f}" for name, us in top)
            report.line(f"- largest at batch {batch}, {n_adapters} adapters (us per replay): {names}")
        report.line()


# (label, schedule_ahead, each LoRA shrink beside its base matmul); overlap_outputs as configured
OPTION_SETTINGS = [("as configured", False, False), ("shrink beside", False, True), ("schedule_ahead", True, False),
                   ("schedule_ahead + shrink beside", True, True)]


def _report_engine_options(report: Report, llm, cases: dict, on_gpu: bool, max_tokens: int) -> None:
    """The base and the adapter case under each of ``OPTION_SETTINGS``, back to back: median
    decode steps, the LoRA overhead each setting gives, the wall time of one replay of the adapter
    case's graph (with the shrink beside, kernels overlap, so the profiler's per-kernel sum is no
    measure of it), and the greedy tokens against the first setting's (neither option changes
    what a step computes). The shrink beside alone does not touch the base step: that row reuses
    the first row's base run."""
    from lab_common import bench_ms
    from step_phases import StepPhases

    from loraplex.engine.cuda_graphs import segment_class

    engine, runner = llm.engine, llm.engine.runner
    graphs = runner.decode_graphs
    medians, tokens, replays, failed = {}, {}, {}, set()
    first = OPTION_SETTINGS[0][0]
    for label, ahead, beside in OPTION_SETTINGS:
        # neither option has run on a GPU before: one that raises costs its own row only
        try:
            engine.schedule_ahead = ahead
            _set_shrink_beside(runner, on_gpu, beside)
            for (batch, n_adapters), (prompts, adapters) in cases.items():
                if beside and not ahead and not n_adapters:
                    key = (first, batch, n_adapters)
                    medians[label, batch, n_adapters], tokens[label, batch, n_adapters] = medians[key], tokens[key]
                    continue
                with _triton_on_cpu(not on_gpu):
                    with StepPhases(llm) as phases:
                        _, tokens[label, batch, n_adapters] = _timed_generate(llm, prompts, adapters, max_tokens)
                    if n_adapters:
                        # the last step's graph on its buffers (every request has ended: the KV
                        # slots it writes belong to no one)
                        key = (graphs.bucket_for(batch), segment_class(batch, -(-batch // n_adapters)))
                        graph = graphs.graphs.get(key)
                        with torch.inference_mode():
                            replays[label] = bench_ms(graph.graph.replay, on_gpu) * 1e3 if graph else float("nan")
                steps = phases.decode_step_seconds(batch)
                medians[label, batch, n_adapters] = statistics.median(steps) * 1e3 if steps else float("nan")
        except Exception:  # noqa: BLE001
            failed.add(label)
            report.raised(f"engine option setting {label!r}")
            if label == first:
                return  # no reference row to set the others against
        finally:
            engine.schedule_ahead = False
            _set_shrink_beside(runner, on_gpu, False)
    (base, lora) = cases
    rows = []
    for label, _, _ in OPTION_SETTINGS:
        if label in failed:
            rows.append([label] + ["FAILED"] * 6)
            continue
        b, lo = medians[label, *base], medians[label, *lora]
        rows.append([label, f"{b:.3f}", f"{lo:.3f}", f"{lo / b - 1:+.1%}", f"{replays[label]:.1f}",
                     _agreement(tokens[label, *base], tokens[first, *base]),
                     _agreement(tokens[label, *lora], tokens[first, *lora])])
        # neither option changes what a step computes: the same greedy tokens, or a bug
        for case in (base, lora):
            if tokens[label, *case] != tokens[first, *case]:
                report.failures.append(f"engine option setting {label!r} changed the greedy tokens at batch "
                                       f"{case[0]}, {case[1]} adapters")
    report.line(f"Engine options, decode step median ms (overlap_outputs {'on' if engine.overlap_outputs else 'off'}; "
                "schedule_ahead: the next decode step is launched before this one's tokens are read back; shrink "
                "beside: each LoRA shrink on a side stream beside its base matmul, overlap_lora_shrink"
                f"{'' if on_gpu else ', on CPU a stand-in for the streams: no figure'}; the shrink beside alone "
                "reuses the first row's base step):")
    report.line()
    report.table(["setting", f"batch {base[0]}, {base[1]} adapters", f"batch {lora[0]}, {lora[1]} adapters",
                  "LoRA overhead", "one replay of the LoRA step's graph us", "base greedy tokens as the first row",
                  "LoRA greedy tokens as the first row"], rows)
    if on_gpu:
        for label, _, _ in OPTION_SETTINGS[1:]:
            if label in failed:
                continue
            overhead = medians[label, *lora] / medians[label, *base] - 1
            report.target(f"{'MET' if overhead <= OVERHEAD_TARGET else 'MISSED'} LoRA step overhead (graphs, {label}) "
                          f"at batch {lora[0]}, {lora[1]} distinct rank-16 adapters: {overhead * 100:+.1f}% "
                          f"(target <= {OVERHEAD_TARGET * 100:.0f}%)")


def _set_shrink_beside(runner, on_gpu: bool, enabled: bool) -> None:
    """``overlap_lora_shrink`` on or off between runs; on CPU a stand-in for the streams makes the
    same calls (the runner's option stays off there: nothing runs asynchronously)."""
    if on_gpu:
        runner.set_overlap_lora_shrink(enabled)
        return
    from bench_kernels import stand_in_overlap

    runner.shrink_overlap = stand_in_overlap() if enabled else None
    runner.decode_graphs.set_shrink_overlap(runner.shrink_overlap)


def _report_memory(report: Report, llm, on_gpu: bool) -> None:
    """The device memory the whole run peaked at, split into weights, KV cache, LoRA slot pool and
    the rest: activations of up to max_num_batched_tokens, CUDA-graph pools, scratch. The rest is
    what the KV budget's reserve (1 - kv_cache_memory_fraction of free memory) has to cover, and
    it does not grow with the number of layers (they run one after another)."""
    from loraplex.config import DEFAULT_KV_CACHE_MEMORY_FRACTION

    runner = llm.engine.runner
    gib = 1 << 30
    kv = sum(t.numel() * t.element_size() for t in runner.kv_caches)
    pool = runner.lora_manager.pool.allocated_bytes if runner.lora_manager is not None else 0
    parts = f"weights {runner.weight_bytes / gib:.2f} GiB, KV cache {kv / gib:.2f} GiB, LoRA slot pool {pool / gib:.2f} GiB"
    if not on_gpu:
        report.line(f"memory (CPU: no peak to read): {parts}")
        report.line()
        return
    peak = torch.cuda.max_memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory
    rest = peak - runner.weight_bytes - kv - pool
    report.line(f"device memory: peak allocated {peak / gib:.2f} GiB = {parts}, and the rest {rest / gib:.2f} GiB "
                f"(activations at up to {llm.engine.config.max_num_batched_tokens} batched tokens, CUDA-graph "
                f"pools, scratch); the KV budget's reserve on this {total / gib:.0f} GiB card is about "
                f"{(1 - DEFAULT_KV_CACHE_MEMORY_FRACTION) * (total - runner.weight_bytes) / gib:.1f} GiB "
                f"({1 - DEFAULT_KV_CACHE_MEMORY_FRACTION:.0%} of the memory free after the weights)")
    report.line()


def _agreement(outs: list[list[int]], other: list[list[int]]) -> str:
    """How many sequences match, and where the others first differ: a flipped near-tie changes
    everything after it, so late scattered first differences are rounding, and differences from
    the first decode steps on point at a wrong step."""
    same = sum(a == b for a, b in zip(outs, other))
    firsts = sorted(next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) for a, b in zip(outs, other) if a != b)
    where = f"; first differing token at step {firsts[0]} earliest, {firsts[len(firsts) // 2]} median" if firsts else ""
    return f"{same} of {len(outs)} sequences{where}"


@contextlib.contextmanager
def _triton_on_cpu(enabled: bool):
    """The CPU smoke's graph rows: dispatch to the Triton kernels (interpreter) for CPU tensors."""
    if not enabled:
        yield
        return
    from loraplex.kernels import dispatch

    saved = dispatch.uses_triton
    dispatch.uses_triton = lambda t: True
    try:
        yield
    finally:
        dispatch.uses_triton = saved


def _overhead(steps: dict, batch: int, n_adapters: int, mode: str) -> str:
    """The LoRA step overhead of a configuration against its batch's base step, as a table cell."""
    base = steps.get((batch, 0, mode))
    return f"{(steps[(batch, n_adapters, mode)] / base - 1) * 100:+.1f}%" if base and n_adapters else "-"


def _measure(llm, prompts, adapters, short: int, max_tokens: int) -> tuple[float, float, float, tuple]:
    """(median decode step seconds, decode step seconds from the difference of run times,
    seconds of the long run, each prompt's generated tokens in each of the two long runs)."""
    from step_phases import StepPhases

    _timed_generate(llm, prompts, adapters, short)  # warm-up: compiles, captures, loads adapters to slots
    # best of two of each: host-side noise only ever adds time
    t_short = min(_timed_generate(llm, prompts, adapters, short)[0] for _ in range(2))
    with StepPhases(llm) as phases:
        runs = [_timed_generate(llm, prompts, adapters, max_tokens) for _ in range(2)]
    t_long = min(t for t, _ in runs)
    steps = phases.decode_step_seconds(len(prompts))
    median = statistics.median(steps) if steps else float("nan")
    return median, (t_long - t_short) / (max_tokens - short), t_long, (runs[0][1], runs[1][1])
