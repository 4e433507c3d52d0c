"""The kernel lab's variant check (kernels/bench_kernels.py) compares shrink variants by their
result, whatever the installed tuning says about where the K splits are summed."""

from __future__ import annotations

from pathlib import Path

import torch

from loraplex.kernels import triton_lora

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def test_shrink_variants_are_compared_by_their_sums_with_split_sum_expand_installed(monkeypatch):
    monkeypatch.syspath_prepend(str(KERNELS))
    from bench_kernels import lora_input_sets, shrink_variant_us
    from lab_common import make_meta, spread_slots

    # the expand adds the partials, and the 512-wide input splits K (16-wide blocks, many programs)
    installed = triton_lora.GemvTuning(split_sum="expand", shrink_tile_elements=256, shrink_programs=1 << 16)
    monkeypatch.setattr(triton_lora, "DEFAULT_TUNING", installed)
    meta = make_meta(spread_slots(8, 8), [16] * 8, "cpu")
    torch.manual_seed(8)
    sets, _, _ = lora_input_sets(8, 8, 512, (64,), torch.float16, "cpu", 1 << 16)
    x, a, _, _, scratch = sets[0]
    assert triton_lora.lora_shrink_triton(x, a, meta, scratch).dim() == 4  # what the check must not compare
    for gemv in ("rows_x_rank", "acc", "dot"):
        us, cell = shrink_variant_us(sets[:1], meta, gemv, on_gpu=False)
        assert us is not None, f"{gemv}: {cell}"
