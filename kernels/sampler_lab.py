"""The sampler's filters on the device: ordering only the batch's largest top_k tokens against a
full sort, drawing among each row's top_k best against over the whole vocabulary, and the
repetition penalty's prompts kept on the device against uploaded each call.

Both changes were measured on CPU only when made (session 21: ``benchmarks/bench_top_k.py``,
``benchmarks/bench_penalty_host.py``); this gives their GPU figures, each pair run on the same
inputs with outputs checked equal. vLLM timed a full sort-based top-k over 256 rows of a 131,072
vocabulary at 3.8 ms on its GPU (vllm-project/vllm#32558).
"""

from __future__ import annotations

import random
import statistics
import time

import torch
from lab_common import Report, bench_ms


def _wall_ms(fn, on_gpu: bool, calls: int) -> float:
    """Median wall milliseconds of ``fn`` from launch to done (host work included)."""
    times = []
    for _ in range(calls):
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if on_gpu:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _penalized_rows(rows: int, prompt_len: int, vocab: int):
    from types import SimpleNamespace

    from loraplex.sampling_params import SamplingParams

    rng = random.Random(0)
    params = SamplingParams(repetition_penalty=1.1, frequency_penalty=0.2)
    return [SimpleNamespace(params=params, seq_id=i, prompt_token_ids=[rng.randrange(vocab) for _ in range(prompt_len)],
                            output_token_ids=[rng.randrange(vocab) for _ in range(100)]) for i in range(rows)]


def bench_sampler(report: Report, on_gpu: bool, device: str) -> None:
    from loraplex.engine import top_k_top_p as filters
    from loraplex.engine.penalties import PromptTokens, apply_penalties

    rows, vocab, prompt_len = (256, 128256, 1000) if on_gpu else (8, 512, 40)
    calls = 20 if on_gpu else 2
    logits = torch.randn(rows, vocab, device=device) * 3
    rows_out = []

    def pair(name: str, first, second, labels: tuple[str, str]) -> None:
        out_a, out_b = first(), second()
        report.check(f"sampler {name}", torch.equal(out_a, out_b), f"{labels[1]} equal to {labels[0]}")
        for label, fn in zip(labels, (first, second)):
            rows_out.append([name, label, f"{bench_ms(fn, on_gpu):.3f}", f"{_wall_ms(fn, on_gpu, calls):.3f}"])

    default_max = filters.PARTIAL_TOP_K_MAX

    def full_sort():
        return filters.apply_top_k_top_p(logits.clone(), [20] * rows, [0.8] * rows)

    def candidates():  # what _draw_among_best keeps, scattered back over the vocabulary
        best, order = logits.topk(20, dim=-1)
        kept = filters.keep_candidates(best, [20] * rows, [0.8] * rows)[0]
        return torch.full_like(logits, float("-inf")).scatter_(1, order, kept)

    pair("top_k 20, top_p 0.8", full_sort, candidates, ("full sort", "topk + keep_candidates"))

    # the whole draw (temperature, filters, softmax, noise, argmax), seeded and not: over the
    # whole vocabulary (the way before) against among each row's top_k best
    from types import SimpleNamespace

    from loraplex.engine.sampler import Sampler
    from loraplex.sampling_params import SamplingParams

    top20 = logits.topk(20, dim=-1).indices
    for seeded in (False, True):
        params = SamplingParams(temperature=0.8, top_k=20, top_p=0.8, seed=7 if seeded else None)
        draw_seqs = [SimpleNamespace(params=params, index=0, output_token_ids=[]) for _ in range(rows)]
        name = f"draw, top_k 20, top_p 0.8{', seeded' if seeded else ''}"

        def draw_with(limit: int, seqs=draw_seqs):
            sampler = Sampler(seed=0, device=device, partial_top_k_max=limit)
            return lambda: sampler._sample_random(logits, seqs, {i: 0 for i in range(rows)})

        for label, fn in (("whole vocabulary", draw_with(0)), ("among the top_k", draw_with(default_max))):
            among = (fn().unsqueeze(1) == top20).any(dim=1).all().item()
            report.check(f"sampler {name}, {label}", among, "every token among its row's 20 best")
            rows_out.append([name, label, f"{bench_ms(fn, on_gpu):.3f}", f"{_wall_ms(fn, on_gpu, calls):.3f}"])

    def top_p_alone():
        return filters.apply_top_k_top_p(logits.clone(), [0] * rows, [0.9] * rows)

    rows_out.append(["top_p 0.9 alone", "full sort", f"{bench_ms(top_p_alone, on_gpu):.3f}",
                     f"{_wall_ms(top_p_alone, on_gpu, calls):.3f}"])

    seqs = _penalized_rows(rows, prompt_len, vocab)
    kept = PromptTokens()
    pair(f"penalties, {prompt_len}-token prompts", lambda: apply_penalties(logits.clone(), seqs, PromptTokens()),
         lambda: apply_penalties(logits.clone(), seqs, kept), ("prompts uploaded", "prompts kept on device"))

    report.line(f"## Sampler filters ({rows} rows, vocabulary {vocab}; ms per call)")
    report.line()
    report.line("device ms: triton's do_bench (CUDA events), so host work hidden behind queued kernels does not "
                "show; wall ms: launch to synchronize, host work included, median of "
                f"{calls} calls. The filter and penalty rows include a clone of the logits.")
    report.line()
    report.table(["filter", "way", "device ms", "wall ms"], rows_out)
