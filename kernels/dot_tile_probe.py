"""Probe: the SGMV kernels' tensor-core (``USE_DOT``) path at each row tile, against the fp32
reference, on segment shapes the GPU check does not otherwise reach.

Why: the H200 call of 2026-12-04 (session 16) found the expand's lab variant ``gemv="dot"``
(decode segments in 16-row tensor-core tiles) WRONG on every case, while the prefill check (64-row
tiles) passed and the interpreter passes all of them. The same kernel at 16 and 32 rows is what
the engine runs for prefill segments of 9 to 32 tokens, so this probe launches the expand kernel
directly over the row tiles (16, 32, 64), column tiles, pipelining stages and operand types, and
the launchers on short prefill segments, to find which configuration is wrong and whether a
change of launch setting mends it.

    python3 kernels/dot_tile_probe.py            # GPU
    python3 kernels/dot_tile_probe.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cpu-smoke", action="store_true")
    args = p.parse_args()
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here.parent)]
    import torch
    import triton

    from lab_common import make_meta, rel_err
    from loraplex.kernels.lora_ref import lora_expand_ref, lora_shrink_ref
    from loraplex.kernels.triton_lora import (
        MAX_SLICES,
        lora_expand_triton,
        lora_shrink_triton,
        max_shrink_partials,
    )
    from loraplex.kernels.triton_lora_expand import _sgmv_expand_kernel

    on_gpu = torch.cuda.is_available() and not args.cpu_smoke
    device = "cuda" if on_gpu else "cpu"
    dtypes = [torch.bfloat16, torch.float16] if on_gpu else [torch.float16]
    hidden, widths = (4096, (4096, 1024, 1024)) if on_gpu else (64, (64, 16, 16))
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    # name -> per-token adapter slots
    shapes = {
        "decode, 4 rows a segment": [t % 16 for t in range(64)],
        "decode, 1 row a segment": list(range(64)),
        "prefill, 12 rows a segment": [t // 12 for t in range(96)],
        "prefill, 24 rows a segment": [t // 24 for t in range(96)],
        "prefill, 300/1/3/70/129/1": [g for g, n in enumerate([300, 1, 3, 70, 129, 1]) for _ in range(n)],
    }
    if not on_gpu:
        shapes = {k: v[:40] for k, v in shapes.items()}
    num_slices, out_total = len(widths), sum(widths)
    offsets = [0] + [sum(widths[: i + 1]) for i in range(num_slices)]
    padded = offsets + [offsets[-1]] * (MAX_SLICES + 1 - len(offsets))
    rows = []
    failures = 0

    def rnd(*s, std=1.0, dtype=torch.float32):
        return (torch.randn(*s, generator=gen) * std).to(device=device, dtype=dtype)

    for dtype in dtypes:
        for shape, slots in shapes.items():
            n_adapters = max(slots) + 1
            meta = make_meta(slots, [16] * n_adapters, device)
            t = len(slots)
            shrunk = rnd(num_slices, t, 16)
            b = rnd(n_adapters, out_total, 16, std=0.25, dtype=dtype)
            scaling = (torch.rand(num_slices, n_adapters, generator=gen) + 0.5).to(device)
            y0 = rnd(t, out_total, dtype=dtype)
            ref = y0.float()
            lora_expand_ref(shrunk, b.float(), scaling, tuple(offsets), meta, ref)
            delta_ref = ref - y0.float()

            def check(label, y):
                nonlocal failures
                err = rel_err(y.float() - y0.float(), delta_ref)
                ok = err < 2e-2
                failures += not ok
                rows.append((str(dtype).split(".")[-1], shape, label, f"{err:.1e}", "ok" if ok else "WRONG"))

            # the launcher, as the engine calls it (its own choice of tiles)
            y = y0.clone()
            lora_expand_triton(shrunk, b, scaling, tuple(offsets), meta, y)
            check("launcher expand", y)
            y = y0.clone()
            lora_expand_triton(shrunk, b, scaling, tuple(offsets), meta, y, gemv="dot")
            check("launcher expand gemv=dot", y)
            # the kernel directly, every row tile / column tile / stage count / operand type
            strides = (*shrunk.stride(), *b.stride(), *scaling.stride(), *y0.stride())
            for block_m in (16, 32, 64):
                for block_n in (64, 128):
                    for stages, warps, use_dot in ((None, 4, True), (1, 4, True), (None, 8, True),
                                                   (None, 4, False)):
                        if not use_dot and (block_m > 16 or block_n > 64):
                            continue
                        if True:
                            tiles_per_seg = triton.cdiv(meta.max_seg_len, block_m)
                            grid = (meta.num_segments * tiles_per_seg, triton.cdiv(max(widths), block_n), num_slices)
                            y = y0.clone()
                            kw = {} if stages is None else {"num_stages": stages}
                            _sgmv_expand_kernel[grid](
                                shrunk, b, scaling, y, meta.token_perm, meta.seg_starts, meta.seg_slot,
                                meta.slot_rank, tiles_per_seg, *padded, *strides,
                                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=16, USE_DOT=use_dot, R_EVEN=True,
                                num_warps=warps, **kw,
                            )
                            check(f"kernel M{block_m} N{block_n} stages {stages or 'default'} warps {warps}"
                                  f"{'' if use_dot else ' no dot'}", y)
            # shrink on the same segments (launcher), both reductions of decode segments
            x = rnd(t, hidden, dtype=dtype)
            a = rnd(num_slices, n_adapters, 16, hidden, std=hidden**-0.5, dtype=dtype)
            want = torch.full((num_slices, t, 16), float("nan"), device=device)
            lora_shrink_ref(x.float(), a.float(), meta, want)
            for gemv in (None, "dot"):
                scratch = torch.full((max_shrink_partials(t), num_slices, t, 16), float("nan"), device=device)
                got = lora_shrink_triton(x, a, meta, scratch, gemv=gemv)
                err = rel_err(got, want)
                ok = err < 2e-2
                failures += not ok
                rows.append((str(dtype).split(".")[-1], shape, f"launcher shrink gemv={gemv}", f"{err:.1e}",
                             "ok" if ok else "WRONG"))
    print("| dtype | segments | launch | rel err of the delta | |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print(f"{failures} wrong of {len(rows)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
