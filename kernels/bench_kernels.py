"""Timing part of the GPU check: median times of the Triton kernels, achieved GB/s against a copy
bandwidth measured in the same run, and the LoRA kernels against the base projection they ride on.

LoRA stacks hold exactly the adapters in use (slots 0..adapters-1). Byte counts are the fewest a kernel must move (README.md, "Roofline"): each distinct adapter's
A and B once (at its real rank), x once, y read and written once, the fp32 shrink output written
by shrink and read by expand; the attention decode reads each sequence's K and V once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types

import torch
from lab_common import Report, bench_ms, make_meta, rel_err, spread_slots

from tests.kernels.helpers import padded_like_a_graph  # the test's: a graph's listing of the same metadata

from loraplex.kernels.lora_meta import LoRABatchMeta
from loraplex.kernels.triton_attention import choose_num_kv_splits, paged_attention_triton
from loraplex.kernels import triton_lora
from loraplex.kernels.triton_lora import (
    EXPAND_VARIANTS,
    GEMV_MAX_SEG_LEN,
    SHRINK_VARIANTS,
    GemvTuning,
    lora_expand_triton,
    lora_shrink_triton,
    max_shrink_partials,
    shrink_split_k,
)
from loraplex.lora.shrink_overlap import ShrinkOverlap
from loraplex.lora.vocab_apply import add_embedding_lora
from loraplex.lora.vocab_slots import VocabStack

ROOFLINE_TARGET = 0.70  # shrink+expand, decode batches of >= 64 tokens
VARIANT_TOLERANCE = 2e-2  # a variant against the one in use, both bf16 (y rounded once each)
RANK = 16


def measure_copy_bandwidth(report: Report, on_gpu: bool, device: str) -> float:
    """Bytes read + written per second by a large device-to-device copy (the memory ceiling)."""
    nbytes = (2 << 30) if on_gpu else (4 << 20)
    src = torch.randn(nbytes // 2, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), on_gpu)
    bw = 2 * nbytes / (ms * 1e-3)
    report.line(f"copy bandwidth: {bw / 1e9:.0f} GB/s ({nbytes >> 20} MiB copied in {ms:.3f} ms, median)")
    report.line()
    del src, dst
    return bw


def _lora_bytes(t, adapters, in_f, widths, elt) -> dict[str, int]:
    s, out_total = len(widths), sum(widths)
    a_bytes = adapters * s * RANK * in_f * elt
    b_bytes = adapters * out_total * RANK * elt
    shrunk = s * t * RANK * 4
    lora_t = t if adapters else 0
    return {
        "shrink": a_bytes + lora_t * in_f * elt + shrunk,
        "expand": b_bytes + shrunk + 2 * lora_t * out_total * elt,
    }


def _l2_bytes(on_gpu: bool) -> int:
    if not on_gpu:
        return 0  # CPU smoke: one input set
    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20))


def _graph_ms(fn, on_gpu: bool, n_sets: int) -> float:
    """Milliseconds per input set of ``fn`` (which runs all ``n_sets`` sets). On the GPU the
    launches are captured in one CUDA graph and its replays timed: launch gaps shrink to what a
    graph-captured engine step sees, and the capture itself proves the launch path is
    graph-safe (no host sync, no allocation outside the graph pool)."""
    if not on_gpu:
        return bench_ms(fn, False) / n_sets
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench_ms(graph.replay, True) / n_sets


def lora_input_sets(tokens: int, adapters: int, in_f: int, widths: tuple[int, ...], dtype, device, l2: int):
    """``(sets, scaling, slice_offsets)``: enough distinct ``(x, A, B, y, scratch)`` sets to span
    3x the L2 (so timed launches read HBM, not the cache), random data, never zeros; ``scratch``
    is the engine's shrink buffer (room for K-split partials)."""
    s, out_total = len(widths), sum(widths)
    nb = _lora_bytes(tokens, adapters, in_f, widths, 2)
    n_sets = max(1, min(256, -(-3 * l2 // (nb["shrink"] + nb["expand"]))))
    sets = [
        (
            torch.randn(tokens, in_f, device=device).to(dtype),
            (torch.randn(s, adapters, RANK, in_f, device=device) * in_f**-0.5).to(dtype),
            (torch.randn(adapters, out_total, RANK, device=device) * 0.25).to(dtype),
            torch.randn(tokens, out_total, device=device).to(dtype),
            torch.empty(max_shrink_partials(tokens), s, tokens, RANK, device=device),
        )
        for _ in range(n_sets)
    ]
    scaling = torch.full((s, adapters), 2.0, device=device)
    offsets = tuple([0] + [sum(widths[: i + 1]) for i in range(s)])
    return sets, scaling, offsets


def variant_us(time_all, error, on_gpu: bool, n_sets: int) -> tuple[float | None, str]:
    """A lab variant's us per launch (None when it failed or its output is not that of the variant
    in use: it is timed, not checked elsewhere) and its table cell, marked WRONG or failed: one
    variant must not end the section."""
    try:
        us = _graph_ms(time_all, on_gpu, n_sets) * 1e3
        err = error()
    except Exception as exc:  # noqa: BLE001
        return None, f"failed ({type(exc).__name__})"
    if err < VARIANT_TOLERANCE:
        return us, f"{us:.1f}"
    return None, f"{us:.1f} WRONG (rel err {err:.1e})"


def shrink_variant_us(sets, meta: LoRABatchMeta, gemv: str, on_gpu: bool,
                      tuning: GemvTuning | None = None) -> tuple[float | None, str]:
    """``variant_us`` of the shrink variant ``gemv`` (launched with ``tuning``, None = the one
    installed) over ``sets``, checked against the one in use."""
    x0, a0, _, _, scratch0 = sets[0]

    def run():
        for x, a, _, _, scratch in sets:
            lora_shrink_triton(x, a, meta, scratch, gemv=gemv, tuning=tuning)

    def error():
        # the sums of the K splits, compared: with split_sum "expand" installed the shrink would
        # return its unsummed partials, split differently by each variant
        summed = dataclasses.replace(tuning or triton_lora.DEFAULT_TUNING, split_sum="launch")
        in_use = dataclasses.replace(triton_lora.DEFAULT_TUNING, split_sum="launch")
        want = lora_shrink_triton(x0, a0, meta, torch.empty_like(scratch0), tuning=in_use).clone()
        return rel_err(lora_shrink_triton(x0, a0, meta, torch.empty_like(scratch0), gemv=gemv, tuning=summed), want)

    return variant_us(run, error, on_gpu, len(sets))


def expand_variant_us(sets, shrunk_sets, scaling, offsets, meta: LoRABatchMeta, gemv: str,
                      on_gpu: bool) -> tuple[float | None, str]:
    """``variant_us`` of the expand variant ``gemv`` (reading ``shrunk_sets``), its delta to y
    checked against the one in use's."""
    _, _, b0, y0, _ = sets[0]

    def run():
        for (_, _, b, y, _), shrunk in zip(sets, shrunk_sets):
            lora_expand_triton(shrunk, b, scaling, offsets, meta, y, gemv=gemv)

    def error():
        # a fresh y: the timed sets' y has taken every timed launch's delta, and at that size one
        # ulp of bf16 y outweighs a delta. "dot" rounds the shrink output to bf16 before its MMA,
        # so its delta differs from the others' in the last bits, and the H200 call of 2026-12-04
        # marked it WRONG for that alone (a probe on fresh y found it right: runs/2026-12-04-h200-5-b72ddf5.md).
        fresh = torch.randn(y0.shape, device=y0.device).to(y0.dtype)
        want, got = fresh.clone(), fresh.clone()
        lora_expand_triton(shrunk_sets[0], b0, scaling, offsets, meta, want)
        lora_expand_triton(shrunk_sets[0], b0, scaling, offsets, meta, got, gemv=gemv)
        return rel_err(got.float() - fresh.float(), want.float() - fresh.float())

    return variant_us(run, error, on_gpu, len(sets))


def shrink_results(sets, meta) -> list[torch.Tensor]:
    """Each input set's shrink result (the first partial of its scratch), made by one default
    shrink per set: what expand reads."""
    return [lora_shrink_triton(x, a, meta, scratch) for x, a, _, _, scratch in sets]


def base_and_lora_us(sets, weights, scaling, offsets, meta: LoRABatchMeta, on_gpu: bool) -> list[str]:
    """Cells: us per projection of base matmul + shrink + expand on one stream, then with the
    shrink beside the matmul (``ShrinkOverlap``), their ratio, and whether their outputs are equal."""
    overlap = ShrinkOverlap.on(torch.device("cuda")) if on_gpu else stand_in_overlap()

    def projection(i, beside):
        x, a, b, _, scratch = sets[i]
        w = weights[i % len(weights)]

        def shrink():
            return lora_shrink_triton(x, a, meta, scratch)

        def base():  # [tokens, out_total]
            return torch.matmul(x, w.t())

        if beside:
            y, shrunk = overlap.run(shrink, base)
        else:
            y, shrunk = base(), shrink()
        lora_expand_triton(shrunk, b, scaling, offsets, meta, y)
        return y

    def timed(beside):
        return _graph_ms(lambda: [projection(i, beside) for i in range(len(sets))], on_gpu, len(sets)) * 1e3

    one, two = timed(False), timed(True)
    equal = torch.equal(projection(0, False), projection(0, True))
    if on_gpu:
        torch.cuda.synchronize()
    return [f"{one:.1f}", f"{two:.1f}", f"{two / one:.2f}", "yes" if equal else "NO"]


def stand_in_overlap() -> ShrinkOverlap:
    """The CPU smoke's: the same calls, no streams."""
    stream = types.SimpleNamespace(wait_stream=lambda other: None)
    return ShrinkOverlap(stream, current=lambda: stream, use=lambda s: contextlib.nullcontext())


def lora_modules(on_gpu: bool) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Module name -> (in features, slice widths): Llama-3-8B's on the GPU, tiny ones on CPU."""
    hidden, kv, inter = (4096, 1024, 14336) if on_gpu else (64, 16, 96)
    return {"qkv": (hidden, (hidden, kv, kv)), "o": (hidden, (hidden,)), "gate_up": (hidden, (inter, inter)),
            "down": (inter, (hidden,))}


def bench_lora(report: Report, on_gpu: bool, device: str, copy_bw: float) -> None:
    dtype = torch.bfloat16 if on_gpu else torch.float16
    elt = 2
    configs = [(64, 1), (64, 16), (64, 64), (256, 16), (256, 64), (256, 128), (2048, 4)] if on_gpu else [(8, 2)]
    modules = lora_modules(on_gpu)
    l2 = _l2_bytes(on_gpu)
    report.line(f"## SGMV LoRA kernels ({dtype}, rank {RANK})")
    report.line()
    report.line(f"Each figure: one CUDA graph running the kernels over enough distinct input sets to span "
                f"3x the L2 ({l2 >> 20} MiB), replayed under do_bench (median), divided by the sets.")
    report.line()
    rows, per_layer, variant_rows, beside_rows = [], {}, [], []
    for tokens, adapters in configs:
        meta = make_meta(spread_slots(tokens, adapters), [RANK] * adapters, device)
        for mod, (in_f, widths) in modules.items():
            out_total = sum(widths)
            nb = _lora_bytes(tokens, adapters, in_f, widths, elt)
            sets, scaling, offsets = lora_input_sets(tokens, adapters, in_f, widths, dtype, device, l2)
            n_sets = len(sets)
            w_bytes = out_total * in_f * elt
            n_w = max(1, min(64, -(-3 * l2 // w_bytes)))
            weights = [(torch.randn(out_total, in_f, device=device) * in_f**-0.5).to(dtype) for _ in range(n_w)]
            x0 = sets[0][0]

            shrunk_sets = shrink_results(sets, meta)  # for the expand-only timings
            splits = shrink_split_k(in_f, len(widths), meta, sets[0][4].shape[0])

            def shrink_all():
                for x, a, _, _, scratch in sets:
                    lora_shrink_triton(x, a, meta, scratch)

            def expand_all():
                for (_, _, b, y, _), shrunk in zip(sets, shrunk_sets):
                    lora_expand_triton(shrunk, b, scaling, offsets, meta, y)

            def both_all(reduction="partials", tuning=None):
                for x, a, b, y, scratch in sets:
                    shrunk = lora_shrink_triton(x, a, meta, scratch, split_reduction=reduction, tuning=tuning)
                    lora_expand_triton(shrunk, b, scaling, offsets, meta, y, tuning=tuning)

            def base_all():
                for w in weights:
                    torch.matmul(x0, w.t())

            t_shrink = _graph_ms(shrink_all, on_gpu, n_sets)
            t_expand = _graph_ms(expand_all, on_gpu, n_sets)
            if meta.max_seg_len <= GEMV_MAX_SEG_LEN:
                # every decode-shaped variant on the same inputs; the one in use (the tuning's
                # for this segment class: what the other columns of this section timed) marked *
                row = [tokens, adapters, mod, meta.max_seg_len]
                tuning = triton_lora.DEFAULT_TUNING  # read now: --tune-lora may have installed another
                for gemv in SHRINK_VARIANTS:
                    in_use = gemv == tuning.shrink_gemv_for(meta.max_seg_len)
                    row.append(f"{t_shrink * 1e3:.1f} *" if in_use else shrink_variant_us(sets, meta, gemv, on_gpu)[1])
                for gemv in EXPAND_VARIANTS:
                    in_use = gemv == tuning.expand_gemv_for(meta.max_seg_len)
                    row.append(f"{t_expand * 1e3:.1f} *" if in_use
                               else expand_variant_us(sets, shrunk_sets, scaling, offsets, meta, gemv, on_gpu)[1])
                variant_rows.append(row)
            t_both = _graph_ms(both_all, on_gpu, n_sets)
            # the K splits combined by fp32 atomics into one zeroed output instead (not
            # deterministic; the default until 2026-12-04): what the partials cost or save
            t_atomic = _graph_ms(lambda: both_all("atomic"), on_gpu, n_sets)
            # the partials added by the expand as it reads them, no launch of their own
            in_expand = dataclasses.replace(triton_lora.DEFAULT_TUNING, split_sum="expand")
            t_in_expand = _graph_ms(lambda: both_all(tuning=in_expand), on_gpu, n_sets)
            t_base = _graph_ms(base_all, on_gpu, n_w)
            if meta.max_seg_len <= GEMV_MAX_SEG_LEN and adapters > 1:
                beside_rows.append([tokens, adapters, mod, f"{t_base * 1e3:.1f}"]
                                   + base_and_lora_us(sets, weights, scaling, offsets, meta, on_gpu))
            frac = (nb["shrink"] + nb["expand"]) / (t_both * 1e-3) / copy_bw
            rows.append([
                tokens, adapters, mod, meta.max_seg_len, n_sets, splits,
                f"{t_shrink * 1e3:.1f}", f"{t_expand * 1e3:.1f}", f"{t_both * 1e3:.1f}", f"{t_atomic * 1e3:.1f}",
                f"{t_in_expand * 1e3:.1f}", f"{frac * 100:.0f}%", f"{t_base * 1e3:.1f}", f"{t_both / t_base * 100:.0f}%",
            ])
            acc = per_layer.setdefault((tokens, adapters), [0.0, 0.0])
            acc[0] += t_both
            acc[1] += t_base
            if 64 <= tokens <= 256:
                ok = frac >= ROOFLINE_TARGET
                report.target(
                    f"{'MET' if ok else 'MISSED'} roofline T={tokens} adapters={adapters} {mod}: shrink+expand at "
                    f"{frac * 100:.0f}% of copy bandwidth (target >= {ROOFLINE_TARGET * 100:.0f}%)"
                )
            del sets, weights, shrunk_sets
    report.table(
        ["tokens", "adapters", "module", "max seg", "sets", "K splits", "shrink us", "expand us", "both us",
         "both us, atomic splits", "both us, splits summed in expand", "of copy BW", "base matmul us", "LoRA/base"],
        rows,
    )
    if variant_rows:
        report.line("Decode-shaped variants (us per launch, same inputs; * the one in use, whose output the "
                    "others are checked against):")
        report.line()
        report.table(["tokens", "adapters", "module", "max seg"] + [f"shrink {g}" for g in SHRINK_VARIANTS]
                     + [f"expand {g}" for g in EXPAND_VARIANTS], variant_rows)
    if beside_rows:
        report.line("Base matmul + LoRA of a projection, as the engine runs them (us per projection, one CUDA graph "
                    "over the input sets, weights as in \"base matmul us\"): on one stream, and with the shrink on a "
                    "side stream beside the base matmul (overlap_lora_shrink; the expand waits for both). The "
                    "outputs of the two are compared (the same kernels: they must be equal)"
                    + ("" if on_gpu else "; CPU: a stand-in for the streams, no figure") + ":")
        report.line()
        report.table(["tokens", "adapters", "module", "base matmul us", "base + LoRA us, one stream",
                      "base + LoRA us, shrink beside", "beside / one stream", "outputs equal"], beside_rows)
    report.line("Per decoder layer (qkv + o + gate_up + down), LoRA kernels against the base matmuls:")
    for (tokens, adapters), (t_lora, t_base) in per_layer.items():
        report.line(f"- T={tokens} adapters={adapters}: LoRA {t_lora * 1e3:.0f} us vs base {t_base * 1e3:.0f} us "
                    f"({t_lora / t_base * 100:.0f}%)")
    report.line()


def bench_graph_metadata(report: Report, on_gpu: bool, device: str) -> None:
    """Shrink + expand at the end-to-end target (256 tokens over 64 adapters) with the exact
    metadata and as a graph lists it for ``max_loras`` 128 (64 spare segments): sized by all 128
    listed segments (the runner until 2026-12-04) or by the segments expected to hold rows."""
    dtype = torch.bfloat16 if on_gpu else torch.float16
    tokens, adapters, listed = (256, 64, 128) if on_gpu else (8, 2, 4)
    exact = make_meta(spread_slots(tokens, adapters), [RANK] * adapters, device)
    metas = {"exact": exact, "graph, sized by listed": padded_like_a_graph(exact, listed, False),
             "graph, sized by expected": padded_like_a_graph(exact, listed, True)}
    l2 = _l2_bytes(on_gpu)
    rows = []
    for mod, (in_f, widths) in lora_modules(on_gpu).items():
        sets, scaling, offsets = lora_input_sets(tokens, adapters, in_f, widths, dtype, device, l2)
        row = [mod]
        for meta in metas.values():
            def both_all(m=meta):
                for x, a, b, y, scratch in sets:
                    lora_expand_triton(lora_shrink_triton(x, a, m, scratch), b, scaling, offsets, m, y)
            row.append(f"{_graph_ms(both_all, on_gpu, len(sets)) * 1e3:.1f}")
        rows.append(row)
        del sets
    report.line(f"## LoRA kernels under a graph's metadata ({tokens} tokens, {adapters} adapters, {listed} segments "
                f"listed; shrink + expand us)")
    report.line()
    report.table(["module"] + list(metas), rows)


def bench_vocab_lora(report: Report, on_gpu: bool, device: str, copy_bw: float) -> None:
    """LoRA on lm_head (shrink then expand over the whole vocabulary, into fp32 logits) and on
    embed_tokens (its A.T rows gathered by token id, then expand into the hidden states:
    ``vocab_apply.add_embedding_lora``), one rank-16 adapter per token group, in a CUDA graph."""
    dtype = torch.bfloat16 if on_gpu else torch.float16
    hidden, vocab = (4096, 128256) if on_gpu else (64, 320)
    configs = [(64, 16), (256, 64)] if on_gpu else [(8, 2)]
    rows = []
    for tokens, adapters in configs:
        meta = make_meta(spread_slots(tokens, adapters), [RANK] * adapters, device)
        scaling = torch.full((1, adapters), 2.0, device=device)
        ranks = torch.full((adapters,), RANK, dtype=torch.int32, device=device)
        # lm_head: A [1, adapters, r, hidden], B [adapters, vocab, r], into fp32 logits
        x = torch.randn(tokens, hidden, device=device).to(dtype)
        a = (torch.randn(1, adapters, RANK, hidden, device=device) * hidden**-0.5).to(dtype)
        b = (torch.randn(adapters, vocab, RANK, device=device) * 0.25).to(dtype)
        logits = torch.randn(tokens, vocab, device=device)
        scratch = torch.empty(max_shrink_partials(tokens), 1, tokens, RANK, device=device)

        def head():
            lora_expand_triton(lora_shrink_triton(x, a, meta, scratch), b, scaling, (0, vocab), meta, logits)

        head_bytes = (a.numel() + b.numel() + x.numel()) * 2 + 2 * logits.numel() * 4
        # embed_tokens: A.T [adapters, vocab, r] (rows gathered), B [adapters, hidden, r]
        stack = VocabStack(a=(torch.randn(adapters, vocab, RANK, device=device) * 0.5).to(dtype),
                           b=(torch.randn(adapters, hidden, RANK, device=device) * 0.25).to(dtype),
                           scaling=scaling, rank=ranks, active=[True] * adapters)
        ids = torch.randint(0, vocab, (tokens,), device=device)
        states = torch.randn(tokens, hidden, device=device).to(dtype)
        shrunk = torch.empty(1, tokens, RANK, device=device)

        def embed():
            add_embedding_lora(stack, meta, ids, states, 1.0, shrunk)

        embed_bytes = tokens * RANK * 2 + stack.b.numel() * 2 + 2 * states.numel() * 2
        for module, fn, nbytes in (("lm_head", head, head_bytes), ("embed_tokens", embed, embed_bytes)):
            us = _graph_ms(fn, on_gpu, 1) * 1e3
            rows.append([module, tokens, adapters, f"{us:.1f}", f"{nbytes / (us * 1e-6) / 1e9:.0f}",
                         f"{nbytes / (us * 1e-6) / copy_bw * 100:.0f}%"])
        del a, b, logits, stack, states
    report.line(f"## LoRA on the vocabulary modules ({dtype}, rank {RANK}, hidden {hidden}, vocab {vocab}; "
                "one CUDA graph per figure, median)")
    report.line()
    report.table(["module", "tokens", "adapters", "us", "GB/s", "of copy BW"], rows)


def bench_attention(report: Report, on_gpu: bool, device: str, copy_bw: float) -> None:
    dtype = torch.bfloat16 if on_gpu else torch.float16
    if on_gpu:
        heads, kv_heads, head_dim = 32, 8, 128
        cases = [(64, 1024, 1), (256, 1024, 1), (256, 4096, 1), (1, 0, 2048), (1, 32768, 1), (8, 8192, 1)]
    else:
        heads, kv_heads, head_dim, cases = 4, 1, 16, [(2, 20, 1), (1, 600, 1)]
    block_size = 16
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if on_gpu else 132
    report.line(f"## Paged attention ({dtype}, {heads} heads / {kv_heads} KV heads, head_dim {head_dim}, block {block_size})")
    report.line()
    rows = []
    for seqs, prefix, q_len in cases:
        seq_len = prefix + q_len
        blocks_per_seq = -(-seq_len // block_size)
        num_blocks = seqs * blocks_per_seq
        cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, device=device).to(dtype)
        tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(seqs, blocks_per_seq)
        query = torch.randn(seqs * q_len, heads, head_dim, device=device).to(dtype)
        args = dict(
            block_tables=tables,
            seq_lens=torch.full((seqs,), seq_len, dtype=torch.int32, device=device),
            query_start_loc=(torch.arange(seqs + 1, device=device) * q_len).to(torch.int32),
            scale=head_dim**-0.5, max_query_len=q_len, max_seq_len=seq_len,
        )
        kv_bytes = seqs * seq_len * kv_heads * head_dim * 2 * 2
        io_bytes = 2 * query.numel() * 2
        flops = 4 * seqs * heads * head_dim * q_len * (prefix + (q_len + 1) / 2)
        chosen = choose_num_kv_splits(seqs, kv_heads, q_len, seq_len, num_sms)
        # the launcher's choice, and for split batches also one program per (sequence, KV head)
        for splits in sorted({chosen, 1}, reverse=True):
            ms = bench_ms(lambda: paged_attention_triton(query, cache, **args, num_kv_splits=splits), on_gpu)
            gbs = (kv_bytes + io_bytes) / (ms * 1e-3)
            label = f"{splits}" + (" (chosen)" if splits == chosen else "")
            rows.append([seqs, prefix, q_len, label, f"{ms * 1e3:.1f}", f"{gbs / 1e9:.0f}",
                         f"{gbs / copy_bw * 100:.0f}%", f"{flops / (ms * 1e-3) / 1e12:.1f}"])
    report.table(["seqs", "prefix", "query len", "KV splits", "us", "GB/s", "of copy BW", "TFLOP/s"], rows)
