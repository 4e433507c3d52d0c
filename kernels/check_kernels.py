"""Correctness part of the GPU check: every Triton kernel in low precision against the fp32 torch
reference, at Llama-3-8B shapes on the GPU (bf16) or tiny shapes under the interpreter (fp16).

Inputs are fresh random values (never zeros), outputs poisoned with NaN before each launch.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch
from lab_common import Report, make_meta, rel_err
from moe_fp8_lab import check_moe_fp8
from moe_lab import check_moe
from moe_lora_lab import check_moe_lora

from loraplex.kernels.attention_ref import paged_attention_ref, write_kv_cache_ref
from loraplex.kernels.lora_ref import lora_expand_ref, lora_shrink_ref
from loraplex.kernels.triton_attention import paged_attention_triton, write_kv_cache_triton
from loraplex.kernels import triton_lora
from loraplex.kernels.triton_lora import (
    lora_expand_triton,
    lora_shrink_triton,
    max_shrink_partials,
    shrink_split_k,
)
from loraplex.model.fp8_weights import dequantize, quantize_per_channel

TOLERANCE = 1e-2  # bf16 operands land between 1e-3 and 1e-2 against an fp32 reference


def _lora_case(report, shape, gen, name, token_slots, ranks, in_features, widths, dtype, device, tuning=None):
    """Shrink then expand on one batch; each compared with the fp32 reference on the same inputs
    (``tuning``: a GemvTuning other than the one installed)."""
    num_slices, max_loras, r_max = len(widths), len(ranks), max(ranks)
    out_total = sum(widths)
    offsets = tuple([0] + [sum(widths[: i + 1]) for i in range(num_slices)])
    meta = make_meta(token_slots, ranks, device)
    t = len(token_slots)

    def rnd(*s, std=1.0):
        return (torch.randn(*s, generator=gen) * std).to(device=device, dtype=dtype)

    x = rnd(t, in_features)
    a = rnd(num_slices, max_loras, r_max, in_features, std=in_features**-0.5)
    b = rnd(max_loras, out_total, r_max, std=16**-0.5)
    scaling = (torch.rand(num_slices, max_loras, generator=gen) + 0.5).to(device)
    # the engine's scratch: room for K-split partial outputs
    scratch = torch.full((max_shrink_partials(t), num_slices, t, r_max), float("nan"), device=device)
    shrunk_ref = torch.full((num_slices, t, r_max), float("nan"), device=device)
    shrunk = lora_shrink_triton(x, a, meta, scratch, tuning=tuning)
    lora_shrink_ref(x.float(), a.float(), meta, shrunk_ref)
    defined = ~shrunk_ref.isnan()
    splits = shrink_split_k(in_features, num_slices, meta, scratch.shape[0], tuning=tuning)
    if shrunk.dim() == 4:  # the split partials, left for expand to add (split_sum "expand")
        summed = shrunk[0].clone()
        for partial in shrunk[1:]:
            summed += partial
        err = rel_err(summed[defined], shrunk_ref[defined])
    else:
        err = rel_err(shrunk[defined], shrunk_ref[defined])
    report.check(f"{name} shrink", err < TOLERANCE and bool(defined.any()),
                 f"rel err {err:.2e} ({shape}, {splits} K splits)")

    y0 = rnd(t, out_total)
    y = y0.clone()
    y_ref = y0.float()
    # the reference shrink output, or with the partials left for expand, the kernel's own
    lora_expand_triton(shrunk if shrunk.dim() == 4 else shrunk_ref, b, scaling, offsets, meta, y, tuning=tuning)
    lora_expand_ref(shrunk_ref, b.float(), scaling, offsets, meta, y_ref)
    err = rel_err(y, y_ref)
    base = torch.tensor([s < 0 for s in token_slots], device=device)
    untouched = bool(torch.equal(y[base], y0[base]))
    report.check(f"{name} expand", err < TOLERANCE and untouched, f"rel err {err:.2e}, base rows untouched={untouched}")


def _lora_repeatability(report, gen, tokens, adapters, in_features, widths, dtype, device, runs: int = 8):
    """Shrink then expand ``runs`` times on the same inputs, per way of combining the K splits:
    how many repeats differ from the first. None may with the partials (added by a launch of
    their own, the default, or by the expand); the fp32 atomics may differ (reported, not failed:
    it is why they are not the default)."""
    num_slices, out_total = len(widths), sum(widths)
    offsets = tuple([0] + [sum(widths[: i + 1]) for i in range(num_slices)])
    meta = make_meta([i % adapters for i in range(tokens)], [16] * adapters, device)
    x = torch.randn(tokens, in_features, generator=gen).to(device=device, dtype=dtype)
    a = (torch.randn(num_slices, adapters, 16, in_features, generator=gen) * in_features**-0.5).to(device, dtype)
    b = (torch.randn(adapters, out_total, 16, generator=gen) * 0.25).to(device=device, dtype=dtype)
    scaling = torch.full((num_slices, adapters), 2.0, device=device)
    y0 = torch.randn(tokens, out_total, generator=gen).to(device=device, dtype=dtype)
    scratch = torch.empty(max_shrink_partials(tokens), num_slices, tokens, 16, device=device)
    splits = shrink_split_k(in_features, num_slices, meta, scratch.shape[0])
    for reduction, split_sum in (("partials", "launch"), ("partials", "expand"), ("atomic", "launch")):
        tuning = dataclasses.replace(triton_lora.DEFAULT_TUNING, split_sum=split_sum)
        outs = []
        for _ in range(runs):
            y = y0.clone()
            lora_expand_triton(lora_shrink_triton(x, a, meta, scratch, split_reduction=reduction, tuning=tuning), b,
                               scaling, offsets, meta, y, tuning=tuning)
            outs.append(y)
        differ = sum(not torch.equal(o, outs[0]) for o in outs[1:])
        if reduction == "partials":
            summed_by = "" if split_sum == "launch" else ", summed in expand"
            report.check(f"LoRA run to run, split-K partials{summed_by}", differ == 0,
                         f"{differ} of {runs - 1} repeats differ from the first ({tokens} tokens, {adapters} adapters, "
                         f"{splits} K splits)")
        else:
            report.line(f"info: LoRA run to run, split-K {reduction}: {differ} of {runs - 1} repeats differ from "
                        f"the first (the same {splits} K splits)")


def _attention_case(report, gen, name, seqs, heads, kv_heads, head_dim, block_size, dtype, device, num_kv_splits=None,
                    free_out_of_window=False, cache_dtype=None, kv_magnitude=None, **options):
    """Mixed prefill-with-prefix + decode batch through shuffled block tables (``num_kv_splits``:
    None lets the launcher choose, as the engine does; ``options``: sliding_window, softcap).
    ``free_out_of_window``: the kernel gets the tables the block manager leaves for a model
    windowed on every layer (entries wholly before each sequence's first query's window are -1,
    FREED_BLOCK); the reference reads the intact tables. ``cache_dtype``: an fp8 KV cache
    (``--kv-cache-dtype``), which the reference reads upcast to fp32. ``kv_magnitude``: K/V that
    large (e4m3 saturates at 448), written and read with calibrated scales (amax / the format's
    largest value, as a checkpoint's k_scale / v_scale), the query as much smaller."""
    seq_lens = [c + q for c, q in seqs]
    per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 4
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seqs), max(per_seq), dtype=torch.int32)
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan")).to(cache_dtype or dtype)
    for i, n in enumerate(per_seq):
        tables[i, :n] = torch.tensor([physical.pop() for _ in range(n)])
    # write every position's K/V with the Triton kernel, checked against the reference write
    slots = []  # from the host copy of the tables: a device read per position would sync each time
    for i, length in enumerate(seq_lens):
        row = tables[i].tolist()
        slots.extend(row[p // block_size] * block_size + p % block_size for p in range(length))
    cache, tables = cache.to(device), tables.to(device)
    n_tok = len(slots)
    keys = torch.randn(n_tok, kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    values = torch.randn(n_tok, kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    scales = {}
    if kv_magnitude is not None:
        keys, values = keys * kv_magnitude, values * kv_magnitude
        limit = torch.finfo(cache_dtype).max
        scales = dict(k_scale=keys.abs().max().item() / limit, v_scale=values.abs().max().item() / limit)
    slot_t = torch.tensor(slots, dtype=torch.int64, device=device)
    cache_ref = cache.clone()
    write_kv_cache_triton(keys, values, cache, slot_t, *scales.values())
    write_kv_cache_ref(keys, values, cache_ref, slot_t, *scales.values())
    wrote, wrote_ref = cache.float(), cache_ref.float()  # fp8 has no nan_to_num
    same = bool(torch.equal(torch.nan_to_num(wrote), torch.nan_to_num(wrote_ref)))
    same = same and bool(torch.equal(wrote.isnan(), wrote_ref.isnan()))
    report.check(f"{name} kv write", same, f"{n_tok} tokens, block size {block_size}, bit-exact={same}")

    q_lens = [q for _, q in seqs]
    num_q = sum(q_lens)
    query = torch.randn(num_q, heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    if kv_magnitude is not None:
        query = query / kv_magnitude
    args = dict(
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0] + q_lens, dtype=torch.int64).cumsum(0).to(torch.int32).to(device),
        scale=head_dim**-0.5,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    out = torch.full_like(query, float("nan"))
    kernel_args = dict(args)
    if free_out_of_window:
        freed = tables.clone()
        for i, (prefix, _) in enumerate(seqs):
            freed[i, : max(0, prefix - options["sliding_window"] + 1) // block_size] = -1
        kernel_args["block_tables"] = freed
    paged_attention_triton(query, cache, out=out, num_kv_splits=num_kv_splits, **kernel_args, **options, **scales)
    ref = paged_attention_ref(query.float(), cache.float(), **args, **options, **scales)
    err = rel_err(out, ref)
    splits = "" if num_kv_splits is None else f", {num_kv_splits} KV splits"
    splits += "".join(f", {k} {v}" for k, v in options.items()) + (", freed entries" if free_out_of_window else "")
    splits += f", {cache_dtype} cache" if cache_dtype is not None else ""
    splits += "".join(f", {k} {v:.3g}" for k, v in scales.items())
    report.check(f"{name} attention", err < TOLERANCE, f"rel err {err:.2e}, seqs (prefix, query)={seqs}{splits}")


def _fp8_weight_case(report, gen, name, tokens, in_features, out_features, dtype, device):
    """An FP8 checkpoint's projection (W8A16): fp8 weight and per-row scales on the device,
    dequantized to ``dtype`` for the matmul, against the fp32 product with the same fp8 weight."""
    weight = torch.randn(out_features, in_features, generator=gen) * in_features**-0.5
    fp8 = quantize_per_channel(weight)
    x = torch.randn(tokens, in_features, generator=gen).to(device=device, dtype=dtype)
    w_dev, s_dev = fp8.weight.to(device), fp8.scale.to(device)
    y = torch.nn.functional.linear(x, dequantize(w_dev, s_dev, dtype, None))
    ref = x.float() @ (fp8.weight.float() * fp8.scale).to(device).T
    err = rel_err(y, ref)
    report.check(name, err < TOLERANCE and w_dev.dtype == torch.float8_e4m3fn,
                 f"rel err {err:.2e} ({tokens} tokens, {in_features} -> {out_features})")


def run_checks(report: Report, on_gpu: bool, lora_only: bool = False) -> None:
    device = "cuda" if on_gpu else "cpu"
    # the interpreter multiplies bf16 wrongly in tl.dot (triton-lang/triton#11584): fp16 there
    dtype = torch.bfloat16 if on_gpu else torch.float16
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed to replay
    gen = torch.Generator().manual_seed(seed)
    report.line(f"## Correctness ({dtype} vs fp32 reference, fresh random inputs, seed {seed})")
    report.line()
    if on_gpu:
        hidden, kv, inter, heads, kv_heads, head_dim = 4096, 1024, 14336, 32, 8, 128
        decode_tokens, prefill_lens = 64, [300, 1, 3, 70, 129, 1]
        attn_seqs = [(0, 300), (1000, 1), (517, 64), (37, 1), (4000, 1), (20, 130)]
        split_seqs, splits = [(20000, 1), (3000, 1), (77, 1)], 13
    else:
        hidden, kv, inter, heads, kv_heads, head_dim = 64, 16, 96, 4, 1, 16
        decode_tokens, prefill_lens = 6, [70, 1, 3]
        attn_seqs = [(0, 20), (40, 1), (17, 9)]
        split_seqs, splits = [(300, 1), (30, 1)], 3
    shape = f"hidden {hidden}, kv {kv}, intermediate {inter}"
    # decode: one token per sequence, each its own rank-16 adapter, two base-only tokens
    slots = list(range(decode_tokens - 2)) + [-1, -1]
    ranks = [16] * (decode_tokens - 2)
    _lora_case(report, shape, gen, "decode qkv", slots, ranks, hidden, (hidden, kv, kv), dtype, device)
    # 4 tokens per adapter (decode-shaped, 4-row tiles), gate_up and down
    n4 = max(2, decode_tokens // 4)
    slots = [t % n4 for t in range(decode_tokens)]
    _lora_case(report, shape, gen, "decode gate_up", slots, [16] * n4, hidden, (inter, inter), dtype, device)
    _lora_case(report, shape, gen, "decode down", slots, [16] * n4, inter, (hidden,), dtype, device)
    # LoRA on lm_head runs the same kernels with the vocabulary as the output width (Llama 3:
    # 128256 columns, far wider than any projection): one rank-16 adapter per decode token
    vocab = 128256 if on_gpu else 320
    head_slots = list(range(decode_tokens - 2)) + [-1, -1]
    _lora_case(report, f"{shape}, vocab {vocab}", gen, "decode lm_head", head_slots, [16] * (decode_tokens - 2),
               hidden, (vocab,), dtype, device)
    # prefill-shaped: long segments beside short ones, ranks 1..128 in one batch
    mixed_ranks = [1, 3, 8, 16, 64, 128]
    slots = [g % len(mixed_ranks) for g, n in enumerate(prefill_lens) for _ in range(n)]
    _lora_case(report, shape, gen, "prefill qkv mixed ranks", slots, mixed_ranks, hidden, (hidden, kv, kv), dtype, device)
    # short prefill segments: 16- and 32-row tensor-core tiles (the case above runs 64-row ones),
    # what a step of short prompts runs; on Hopper these take mma.sync, the 64-row tile wgmma
    for name, lens in (("prefill qkv 9-16 rows", [12, 9, 16, 5, 1]), ("prefill gate_up 17-32 rows", [24, 17, 32, 3])):
        slots = [g for g, n in enumerate(lens) for _ in range(n)]
        widths = (hidden, kv, kv) if "qkv" in name else (inter, inter)
        _lora_case(report, shape, gen, name, slots, [16, 8, 16, 3, 16][: len(lens)], hidden, widths, dtype, device)
    # the K splits' partials added by the expand as it reads them (split_sum "expand", the lab's
    # alternative to their own launch; decode-shaped steps). On CPU a wider input than the tiny
    # intermediate size, so that the shrink splits K
    in_expand = dataclasses.replace(triton_lora.DEFAULT_TUNING, split_sum="expand")
    _lora_case(report, shape, gen, "decode down, partials summed in expand", [t % n4 for t in range(decode_tokens)],
               [16] * n4, inter if on_gpu else 2048, (hidden,), dtype, device, tuning=in_expand)
    # the same inputs give the same output every time (the e2e run-twice comparison of
    # 2026-12-04 found greedy tokens differing with the atomic split-K); on CPU a wider input
    # than the tiny hidden size, so that the shrink splits K there too
    rep_tokens, rep_adapters, rep_in = (256, 64, hidden) if on_gpu else (8, 2, 2048)
    _lora_repeatability(report, gen, rep_tokens, rep_adapters, rep_in, (hidden, kv, kv), dtype, device)
    if lora_only:
        return
    for block_size in (16, 32):
        _attention_case(
            report, gen, f"bs{block_size}", attn_seqs, heads, kv_heads, head_dim, block_size, dtype, device
        )
    # a small decode batch over long contexts: keys split across programs, then merged
    _attention_case(
        report, gen, "decode split-KV bs16", split_seqs, heads, kv_heads, head_dim, 16, dtype, device, splits
    )
    # --kv-cache-dtype fp8 (e4m3) / fp8_e5m2: one-byte K/V, dequantized in the kernel, with a
    # checkpoint's calibrated k_scale / v_scale (K/V of 1000s: e4m3 > 1, e5m2 < 1)
    _attention_case(report, gen, "fp8 e4m3 cache bs16", attn_seqs, heads, kv_heads, head_dim, 16, dtype, device,
                    cache_dtype=torch.float8_e4m3fn, kv_magnitude=1000.0)
    _attention_case(report, gen, "fp8 e5m2 cache split-KV", split_seqs, heads, kv_heads, head_dim, 16, dtype, device,
                    splits, cache_dtype=torch.float8_e5m2, kv_magnitude=1000.0)
    # Gemma 2's windowed layers: head_dim 256 (gemma-2-9b: 16 heads over 8 KV heads), a window
    # shorter than the contexts and a soft-cap small enough to bite on random inputs
    g_heads, g_kv, g_dim, window = (16, 8, 256, 1000) if on_gpu else (4, 2, 32, 10)
    # (a windowed layer group gives back the pages before its window, -1 in its table: the
    # second case reads such tables; the first the intact ones)
    for name, seqs, split, freed in (("gemma2 window+softcap bs16", attn_seqs, None, False),
                                     ("gemma2 window+softcap, freed blocks, split-KV", split_seqs, splits, True)):
        _attention_case(report, gen, name, seqs, g_heads, g_kv, g_dim, 16, dtype, device, split,
                        free_out_of_window=freed, sliding_window=window, softcap=2.0)
    # Mistral v0.1: every layer windowed (4096), so blocks before the window are given back and
    # their table entries are -1: the kernel must never read them (a read faults or gives NaN)
    m_window = 4096 if on_gpu else 12
    m_seqs = [(20000, 1), (4000, 1), (517, 64), (9000, 300)] if on_gpu else [(60, 1), (30, 9), (5, 7)]
    for name, split in (("mistral window, freed blocks, bs16", None), ("mistral window, freed blocks, split-KV", splits)):
        _attention_case(report, gen, name, m_seqs, heads, kv_heads, head_dim, 16, dtype, device, split,
                        free_out_of_window=True, sliding_window=m_window)
    # an FP8 checkpoint's gate_up projection, dequantized on the device for a bf16 matmul
    _fp8_weight_case(report, gen, "fp8 weights (W8A16) gate_up", decode_tokens, hidden, 2 * inter, dtype, device)
    # the fused MoE kernels at Qwen3-30B-A3B's expert shapes (moe_lab.py)
    check_moe(report, on_gpu, gen, dtype, device)
    check_moe_lora(report, on_gpu, gen, dtype, device)
    check_moe_fp8(report, on_gpu, gen, dtype, device)  # fp8 experts, W8A16 (moe_fp8_lab.py)
