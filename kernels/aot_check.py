"""Compile every kernel variant for Hopper (sm_90) ahead of time, on a machine without a GPU.

    .venv/bin/python kernels/aot_check.py [--quick] [--arch 90]

Uses Triton's own compiler and the ptxas/cuobjdump shipped in its wheel: a kernel that only
compiles under the interpreter fails here, and the resource report (registers, local memory
= spills, shared memory) and the matrix instructions in the SASS (HGMMA = wgmma, HMMA = mma.sync)
are read without device time. The variants are the constexpr sets the launchers produce
(``shrink_tiles`` / ``expand_tiles`` / ``attention_tiles``). Arguments are typed as a real launch
would see them: 16-byte-aligned pointers, strides of 1 as constants, strides that are multiples
of 16 marked so (Triton's default specialisation), KV-cache strides as i64 (large caches).
Exit status 1 if any variant fails to compile or spills.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, even when run from the test suite
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from loraplex.kernels import triton_attention as ta  # noqa: E402
from loraplex.kernels import triton_lora as tl_lora  # noqa: E402
from loraplex.kernels import triton_lora_expand as tl_expand  # noqa: E402
from loraplex.kernels import triton_lora_shrink as tl_shrink  # noqa: E402
from loraplex.kernels import triton_moe as tm  # noqa: E402
from loraplex.kernels import triton_moe_lora as tml  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
UNIT = {"stride_xk", "stride_ak", "stride_or", "stride_sr", "stride_br", "stride_yn", "stride_cl",
        "stride_kd", "stride_vd", "stride_cd", "stride_qd", "stride_od", "stride_pd", "stride_lh",
        "stride_wk", "stride_ai", "stride_on"}
I64 = {"stride_ckv", "stride_cb"}  # a KV cache of tens of GB: these exceed int32
# do_not_specialize, or small
NOT_DIV16 = {"num_pairs", "top_k", "tiles_per_seg", "k_blocks_per_split", "n_tiles", "num_partials", "num_tokens",
             "r_max", "num_kv_heads", "num_kv_splits", "window"}


def _variants(quick: bool) -> list[tuple[str, object, dict, dict]]:
    """(label, kernel, pointer dtypes, constexprs) for each variant to compile."""
    lora_ptrs = {"x_ptr": "bf16", "a_ptr": "bf16", "out_ptr": "fp32", "token_perm_ptr": "i64",
                 "seg_starts_ptr": "i32", "seg_slot_ptr": "i32", "slot_rank_ptr": "i32",
                 "s_ptr": "fp32", "b_ptr": "bf16", "scaling_ptr": "fp32", "y_ptr": "bf16"}
    attn_ptrs = {"q_ptr": "bf16", "kv_ptr": "bf16", "out_ptr": "bf16", "block_tables_ptr": "i32",
                 "seq_lens_ptr": "i32", "query_start_ptr": "i32", "key_ptr": "bf16", "value_ptr": "bf16",
                 "slot_ptr": "i64", "lse_ptr": "fp32", "partial_ptr": "fp32"}
    split_ptrs = {**attn_ptrs, "out_ptr": "fp32"}  # split-KV programs write fp32 partials
    seg_lens = [1, 8, 64] if quick else [1, 2, 4, 8, 16, 64]
    ranks = [16] if quick else [16, 128]
    out = []
    for seg in seg_lens:
        for rank in ranks:
            # the decode-shaped reductions the GPU check times side by side (the default first)
            gemvs = [tl_lora.DEFAULT_SHRINK_GEMV]
            if not quick and not tl_lora.shrink_tiles(seg, rank)["USE_DOT"]:
                gemvs += [g for g in tl_lora.SHRINK_VARIANTS if g != tl_lora.DEFAULT_SHRINK_GEMV]
            for gemv in gemvs:
                shrink = tl_lora.shrink_tiles(seg, rank, gemv)
                # split-K partials (stores, the default) and the atomic form the lab compares
                for atomic in ([False] if quick else [False, True]):
                    name = "" if gemv == tl_lora.DEFAULT_SHRINK_GEMV else f" {gemv}"
                    label = f"shrink seg<={seg} r{rank}{name}{' atomic' if atomic else ''}"
                    consts = {**shrink, "ATOMIC": atomic, "EVEN_K": True}  # Llama: in % 256 == 0
                    out.append((label, tl_shrink._sgmv_shrink_kernel, lora_ptrs, consts))
            decode = not tl_lora.expand_tiles(seg, rank).get("USE_DOT", False)
            expands = list(tl_lora.EXPAND_VARIANTS) if not quick and decode else [tl_lora.DEFAULT_EXPAND_GEMV]
            for gemv in expands:
                consts = {**tl_lora.expand_tiles(seg, rank, gemv), "R_EVEN": True}  # r_max % 16 == 0
                kernel = tl_expand._sgmv_expand_gemv_kernel if consts.pop("GEMV_TILED") else tl_expand._sgmv_expand_kernel
                name = f" {gemv}" if len(expands) > 1 else ""
                # the shrink's split-K partials summed by the expand as it reads them (split_sum "expand")
                for sums in ([False] if quick or rank > 16 else [False, True]):
                    label = f"expand seg<={seg} r{rank}{name}{' summing partials' if sums else ''}"
                    out.append((label, kernel, lora_ptrs, {**consts, "SUM_PARTIALS": sums}))
    for block_r in ([16] if quick else [16, 128]):  # the K splits' partials summed (decode: 32 x 16 tiles)
        block_t = max(1, tl_lora.SUM_TILE_ELEMENTS // block_r)
        out.append((f"shrink partials sum r{block_r}", tl_shrink._sum_partials_kernel, lora_ptrs,
                    dict(BLOCK_T=block_t, BLOCK_R=block_r, EVEN_R=True)))
    groups = [4] if quick else [1, 4, 8]
    for group in groups:
        for q_len in (1, 512):
            block_m, block_q, block_n = ta.attention_tiles(group, q_len)
            for block_size in ([16] if quick else [16, 32]):
                consts = dict(GROUP=group, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q,
                              BLOCK_N=block_n, BLOCK_D=128, SPLIT_KV=False, SLIDING=False, SOFTCAP=False)
                kind = "decode" if q_len == 1 else "prefill"
                out.append((f"attention {kind} group {group} bs{block_size}", ta._paged_attention_kernel,
                            attn_ptrs, consts))
                if q_len == 1:  # the host splits the keys of decode batches only
                    out.append((f"attention decode split-KV group {group} bs{block_size}",
                                ta._paged_attention_kernel, split_ptrs, {**consts, "SPLIT_KV": True}))
    for q_len in (1, 512):  # Gemma 2's local layers: head_dim 256, 2 heads per KV head, window + soft-cap
        block_m, block_q, block_n = ta.attention_tiles(2, q_len)
        consts = dict(GROUP=2, BLOCK_SIZE=16, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_D=256,
                      SPLIT_KV=q_len == 1, SLIDING=True, SOFTCAP=True)
        out.append((f"attention {'decode split-KV' if q_len == 1 else 'prefill'} gemma2 d256 window softcap",
                    ta._paged_attention_kernel, split_ptrs if q_len == 1 else attn_ptrs, consts))
    for block_s in ([32] if quick else [4, 32]):
        out.append((f"merge {block_s} KV splits d128", ta._merge_kv_splits_kernel, attn_ptrs,
                    dict(BLOCK_S=block_s, BLOCK_D=128)))
    out.append(("kv write 8x128 bs16", ta._write_kv_kernel, attn_ptrs, dict(BLOCK_SIZE=16, BLOCK=1024)))
    # fused MoE at Qwen3-30B-A3B's expert shapes (E=128, top-8, H=2048, I=768): decode and prefill tiles
    moe_ptrs = {"x_ptr": "bf16", "w_ptr": "bf16", "act_ptr": "bf16", "sorted_ids_ptr": "i64",
                "block_expert_ptr": "i64", "num_padded_ptr": "i64", "weight_ptr": "bf16", "out_ptr": "fp32",
                "delta_ptr": "fp32", "scale_ptr": "fp32"}
    plain = dict(HAS_DELTA=False, W_FP8=False, SCALE_COLS=0, AS_BITS=False, FP8_UNIT=1.0)
    # fp8 experts with 128x128 block scales (Qwen3-30B-A3B-FP8) and expert LoRA deltas; the byte
    # path (AS_BITS) is what GPUs without Triton's e4m3 type (before sm_89) run
    fp8_kinds = [("fp8 block128 + LoRA", "fp8e4nv", dict(HAS_DELTA=True, W_FP8=True, SCALE_COLS=128,
                                                          AS_BITS=False, FP8_UNIT=1.0))]
    if not quick:
        fp8_kinds.append(("fp8 bytes per-row", "u8", dict(HAS_DELTA=False, W_FP8=True, SCALE_COLS=0,
                                                           AS_BITS=True, FP8_UNIT=256.0)))
    for tokens in ([1] if quick else [1, 1024]):
        tiles = tm.moe_tiles(tokens * 8, 128, 2048, 768)
        m = tiles["BLOCK_M"]
        for kind, w_dtype, flags in [("", "bf16", plain), *[(f" {k}", w, f) for k, w, f in fp8_kinds]]:
            ptrs = {**moe_ptrs, "w_ptr": w_dtype}
            k_up = min(tiles["gate_up_k"], 128) if flags["SCALE_COLS"] else tiles["gate_up_k"]
            k_down = min(tiles["down_k"], 128) if flags["SCALE_COLS"] else tiles["down_k"]
            out.append((f"moe gate_up BLOCK_M {m}{kind}", tm._moe_gate_up_kernel, ptrs,
                        dict(BLOCK_M=m, BLOCK_N=tiles["gate_up_n"], BLOCK_K=k_up, EVEN_K=True, **flags)))
            out.append((f"moe down BLOCK_M {m}{kind}", tm._moe_down_kernel, ptrs,
                        dict(BLOCK_M=m, BLOCK_N=tiles["down_n"], BLOCK_K=k_down, EVEN_K=True,
                             ROUND_WEIGHTED=True, **flags)))
    # expert LoRA's per-pair shrink and expand (rank 16, Qwen3-30B-A3B's gate_up input H=2048)
    pair_ptrs = {"inp_ptr": "bf16", "a_ptr": "bf16", "scaling_ptr": "fp32", "u_ptr": "fp32",
                 "pair_slot_ptr": "i64", "pair_expert_ptr": "i64", "slot_rank_ptr": "i32", "b_ptr": "bf16",
                 "out_ptr": "fp32"}
    out.append(("expert LoRA pair shrink r16", tml._pair_shrink_kernel, pair_ptrs, dict(BLOCK_R=16, BLOCK_K=128)))
    out.append(("expert LoRA pair expand r16", tml._pair_expand_kernel, pair_ptrs, dict(BLOCK_N=64, BLOCK_R=16)))
    return out


def _compile(kernel, ptrs: dict, consts: dict, arch: int):
    names = kernel.arg_names
    sig, constexprs, attrs = {}, dict(consts), {}
    for i, name in enumerate(names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in UNIT:
            sig[name] = "constexpr"
            constexprs[name] = 1
        elif name.endswith("_ptr"):
            sig[name] = "*" + ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("qk_scale", "softcap_log2", "v_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i64" if name in I64 else "i32"
            if name not in NOT_DIV16:  # Llama shapes: strides, sizes and offsets are multiples of 16
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(kernel, sig, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})


def _inspect(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([str(CUOBJDUMP), "-sass", f.name], capture_output=True, text=True).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    return {
        "reg": int(fields.get("REG", -1)), "stack": int(fields.get("STACK", -1)),
        "local": int(fields.get("LOCAL", -1)), "shared": int(fields.get("SHARED", -1)),
        "hgmma": sass.count("HGMMA"), "hmma": sass.count("HMMA"),
        "loads": _load_widths(sass),
        # layout changes and cross-warp reductions go through shared memory behind barriers
        "smem": f"{len(re.findall(r'[ ]STS[. ]', sass))}/{len(re.findall(r'[ ]LDS[. ]', sass))}/{sass.count('BAR.SYNC')}",
    }


def _load_widths(sass: str) -> str:
    """Global loads by width, e.g. ``128b:12 16b:4``: 128-bit loads are what bandwidth needs."""
    counts: dict[int, int] = {}
    for op in re.findall(r"\bLDG(?:\.[A-Z0-9_]+)*", sass):
        width = 32
        for part in op.split(".")[1:]:
            if part in ("64", "128"):
                width = int(part)
            elif part in ("U16", "S16"):
                width = 16
            elif part in ("U8", "S8"):
                width = 8
        counts[width] = counts.get(width, 0) + 1
    text = " ".join(f"{w}b:{n}" for w, n in sorted(counts.items(), reverse=True)) or "-"
    async_copies = len(re.findall(r"\bLDGSTS(?:\.[A-Z0-9_]+)*", sass))  # cp.async into shared memory
    return text + (f" cp.async:{async_copies}" if async_copies else "")


def main() -> int:
    p = argparse.ArgumentParser(description="compile loraplex's Triton kernels for a GPU without one")
    p.add_argument("--quick", action="store_true", help="a few variants (the CI test)")
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    args = p.parse_args()
    print(f"triton {triton.__version__}, target sm_{args.arch}, num_warps 4")
    print("| variant | regs | stack | local | shared B | HGMMA | HMMA | global loads | STS/LDS/BAR | compile s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    failures = []
    for label, kernel, ptrs, consts in _variants(args.quick):
        t0 = time.time()
        try:
            compiled = _compile(kernel, ptrs, consts, args.arch)
        except Exception as exc:  # report every variant, then fail
            failures.append(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            print(f"| {label} | COMPILE FAILED | | | | | | | | |", flush=True)
            continue
        r = _inspect(compiled.asm["cubin"])
        print(f"| {label} | {r['reg']} | {r['stack']} | {r['local']} | {r['shared']} | {r['hgmma']} | "
              f"{r['hmma']} | {r['loads']} | {r['smem']} | {time.time() - t0:.1f} |", flush=True)
        if r["local"] > 0 or r["stack"] > 0:
            failures.append(f"{label}: spills ({r['stack']} B stack, {r['local']} B local)")
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
