"""The GPU check script runs end to end on CPU (interpreter, tiny shapes), so it ships tested."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loraplex.kernels.triton_lora import GemvTuning

REPO = Path(__file__).resolve().parents[2]


def _variants_in_use(results: str, row_start: str) -> list[str]:
    """The columns marked in use (``*``) in the bench's decode-variant table row that starts so."""
    lines = results.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("| tokens | adapters | module | max seg | shrink "))
    names = [c.strip() for c in lines[at].split("|")[5:-1]]
    table = lines[at + 2 : next(i for i in range(at, len(lines)) if not lines[i].startswith("|"))]
    (row,) = [x for x in table if x.startswith(row_start)]
    return [n for n, c in zip(names, row.split("|")[5:-1]) if c.strip().endswith(" *")]


@pytest.mark.slow
def test_gpu_check_cpu_smoke_passes_and_writes_results(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "kernels" / "gpu_check.py"), "--cpu-smoke"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = (tmp_path / "results.md").read_text()
    assert "FAIL" not in results
    # every kernel was checked against its reference
    for name in ("decode qkv shrink", "decode qkv expand", "prefill qkv mixed ranks expand",
                 "bs16 kv write", "bs16 attention", "bs32 attention", "gemma2 window+softcap bs16 attention",
                 "gemma2 window+softcap, freed blocks, split-KV attention", "decode lm_head shrink",
                 "decode lm_head expand", "fused moe T=1 torch.float16 (Qwen) weights",
                 "fused moe T=17 fp32 (Mixtral) weights", "fp8 weights (W8A16) gate_up",
                 "fp8 e4m3 cache bs16 attention", "fused moe + expert LoRA T=1 torch.float16",
                 "fused moe + expert LoRA T=17 torch.float16"):
        assert f"PASS {name}:" in results
    # the fp8 cases run with calibrated KV-cache scales (K/V beyond e4m3's 448), not 1.0
    for name in ("fp8 e4m3 cache bs16 attention", "fp8 e5m2 cache split-KV attention"):
        (line,) = [x for x in results.splitlines() if x.startswith(f"PASS {name}:")]
        assert ", k_scale " in line and ", v_scale " in line and ", k_scale 1," not in line
    assert "copy bandwidth:" in results and "## Paged attention" in results and "## Fused MoE" in results
    assert "## Fused MoE with expert LoRA" in results
    # the sampler's filters, each pair on the same inputs with equal outputs
    assert "## Sampler filters" in results
    for name in ("top_k 20, top_p 0.8", "penalties, 40-token prompts"):
        assert f"PASS sampler {name}:" in results
    assert "| top_k 20, top_p 0.8 | topk + keep_candidates |" in results
    assert "| penalties, 40-token prompts | prompts kept on device |" in results
    for name in ("draw, top_k 20, top_p 0.8", "draw, top_k 20, top_p 0.8, seeded"):
        for way in ("whole vocabulary", "among the top_k"):
            assert f"PASS sampler {name}, {way}:" in results and f"| {name} | {way} |" in results
    # the end-to-end part ran both decode modes (graphs: interpreter + eager stand-in capture),
    # and the graph path gave the eager path's tokens (float32 on CPU)
    assert "## End to end" in results and "end-to-end run FAILED" not in results
    assert "| 4 | 2 | graphs |" in results and "| 4 | 2 | eager |" in results
    # each row also written as soon as it is measured (a device call cut short keeps them)
    assert "- measured: batch 4, 2 adapters, graphs: decode step " in results
    # the decode step is the median of the steps that ran one token for each of the 4 sequences
    # (a number, so such steps were found), beside the difference of run totals
    assert "| decode step ms (median) |" in results and "| decode step ms (run totals) |" in results
    (row,) = [x for x in results.splitlines() if x.startswith("| 4 | 2 | graphs |")]
    assert math.isfinite(float(row.split("|")[5])) and math.isfinite(float(row.split("|")[8]))
    assert "batch 4, 2 adapters: graph and eager greedy tokens identical for 4 of 4 sequences" in results
    assert "Decode-shaped variants" in results and "| shrink reduce | shrink acc | shrink rows_x_rank |" in results
    # without tuning, the defaults are the variants in use (marked *), the others checked against them
    defaults = GemvTuning()
    assert _variants_in_use(results, "| 8 | 2 | qkv | 4 | ") == [f"shrink {defaults.shrink_gemv_for(4)}",
                                                                 f"expand {defaults.expand_gemv_for(4)}"]
    # lm_head and embed_tokens LoRA timed; the engine's memory split after the end-to-end rows
    assert "## LoRA on the vocabulary modules" in results
    assert "| lm_head | 8 | 2 |" in results and "| embed_tokens | 8 | 2 |" in results
    assert "memory (CPU: no peak to read): weights " in results
    # every variant ran and matched the default's output
    assert "| shrink dot |" in results and "| expand dot |" in results
    assert " WRONG (" not in results and "failed (" not in results
    # each mode also run twice, to tell run-to-run rounding from a graph-vs-eager difference
    assert "batch 4, 2 adapters, graphs run twice: identical for 4 of 4 sequences" in results
    # the kernels' own repeat check splits K (the partials the expand sums in order)
    (line,) = [x for x in results.splitlines() if x.startswith("PASS LoRA run to run, split-K partials:")]
    assert " 0 of 7 repeats differ" in line and " 1 K splits" not in line
    assert "PASS LoRA run to run, split-K partials, summed in expand: 0 of 7 repeats differ" in results
    # the expand adding the partials itself: checked against the reference, and timed beside the sum launch
    (line,) = [x for x in results.splitlines() if x.startswith("PASS decode down, partials summed in expand shrink:")]
    assert " 1 K splits" not in line
    assert "PASS decode down, partials summed in expand expand:" in results
    assert "| K splits |" in results and "| both us, atomic splits | both us, splits summed in expand |" in results
    # the graph steps split into host phases, base and with adapters, the LoRA copy among them
    assert "Host milliseconds per graph-replayed decode step" in results
    assert ("| phase | batch 4, 0 adapters | batch 4, 2 adapters | batch 4, 0 adapters, overlapped "
            "| batch 4, 2 adapters, overlapped |") in results
    # the same runs with overlap_outputs on (off is the CPU default): the same greedy tokens
    for n in (0, 2):
        assert f"- batch 4, {n} adapters: decode step median" in results
        (line,) = [x for x in results.splitlines() if x.startswith(f"- batch 4, {n} adapters: decode step median")]
        assert line.endswith("greedy tokens identical for 4 of 4 sequences"), line
    (lora_row,) = [x for x in results.splitlines() if x.startswith("| LoRA metadata: copy to graph buffers |")]
    assert float(lora_row.split("|")[2]) == 0.0 and float(lora_row.split("|")[3]) > 0.0
    # the kernels' table of base + LoRA with each shrink beside its base matmul (a stand-in for
    # the streams on CPU) and without: the same outputs
    assert "| base + LoRA us, one stream | base + LoRA us, shrink beside | beside / one stream | outputs equal |" in results
    (row,) = [x for x in results.splitlines() if x.startswith("| 8 | 2 | qkv | ") and x.endswith("|")
              and x.count("|") == 9]
    assert row.split("|")[-2].strip() == "yes", row
    # the engine options side by side: schedule_ahead and the shrink beside compute the same
    # tokens; each LoRA row times one replay of its step's graph
    assert "Engine options, decode step median ms" in results
    for label in ("as configured", "shrink beside", "schedule_ahead", "schedule_ahead + shrink beside"):
        (row,) = [x for x in results.splitlines() if x.startswith(f"| {label} |")]
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert all(math.isfinite(float(cells[i])) and float(cells[i]) > 0 for i in (1, 2, 4)), row
        assert cells[5] == cells[6] == "4 of 4 sequences", row
    assert "| schedule ahead |" in results  # its own phase in the host table
    # and what no phase covers, so the rows add up to the step
    assert "| rest of the step (the rest of execute and of the engine's step) |" in results
    assert "| outputs (detokenizing, output objects) |" in results and "| tokens read back (waits for the GPU) |" in results
    # and each case's captured step replayed under the profiler, its time by kernel group
    assert "microseconds per replay of the step's CUDA graph, by kernel group" in results
    (total_row,) = [x for x in results.splitlines() if x.startswith("| total |")]
    assert all(float(v) > 0.0 for v in total_row.split("|")[2:4])


@pytest.mark.slow
def test_gpu_check_tune_lora_runs_with_the_fastest_setting(tmp_path):
    """``--tune-lora --only-lora``: the launch-size table, the choice, then LoRA sections only."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "kernels" / "gpu_check.py"), "--cpu-smoke", "--tune-lora", "--only-lora",
         "--skip-e2e"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = (tmp_path / "results.md").read_text()
    # first the variants per segment class (8 tokens over 2 adapters: class 4; over 8: class 1)
    assert "## Decode-shaped LoRA variants" in results
    assert "| 8 | 2 | qkv | 4 |" in results and "| 8 | 8 | down | 1 |" in results
    assert " WRONG (" not in results and "failed (" not in results
    (variants,) = [x for x in results.splitlines() if x.startswith("variants per segment class (1, 2, 4, 8): ")]
    assert "## Decode-shaped LoRA launch sizes" in results and "(default) |" in results
    (chosen,) = [x for x in results.splitlines() if x.startswith("chosen: GemvTuning(")]
    assert "shrink_programs=" in chosen and "expand_num_warps=" in chosen
    # the dot shrink's pipeline swept when a class runs it
    assert ("## The dot shrink's pipeline" in results) == ("'dot'" in chosen.split("shrink_gemv=(")[1].split(")")[0])
    # then where the split-K partials are added, both ways giving the same y, the faster chosen
    assert "## Where the shrink's K-split partials are added" in results and " DIFFERS" not in results
    (totals,) = [x for x in results.splitlines() if x.startswith("totals: launch ")]
    assert f"split_sum='{totals.split('chosen: ')[1]}'" in chosen
    # what was chosen is what the rest of the run used: the bench marks it in use (*) for class 4
    shrink_4 = variants.split("shrink (")[1].split(")")[0].replace("'", "").split(", ")[2]
    expand_4 = variants.split("expand (")[1].split(")")[0].replace("'", "").split(", ")[2]
    assert "shrink_gemv=(" in chosen and f"'{shrink_4}'" in chosen
    assert _variants_in_use(results, "| 8 | 2 | qkv | 4 | ") == [f"shrink {shrink_4}", f"expand {expand_4}"]
    assert "PASS decode qkv shrink:" in results and "PASS prefill qkv mixed ranks expand:" in results
    assert "## SGMV LoRA kernels" in results
    assert "## Paged attention" not in results and "fused moe" not in results and "## End to end" not in results
