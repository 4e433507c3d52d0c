"""SGMV shrink/expand Triton kernels (interpreter, CPU) against the torch reference in lora_ref."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.helpers import make_meta, nan_like, padded_like_a_graph, randn, rel_err

from loraplex.kernels.lora_ref import lora_expand_ref, lora_shrink_ref  # noqa: E402
from loraplex.kernels.triton_lora import (  # noqa: E402
    EXPAND_VARIANTS,
    SHRINK_VARIANTS,
    SPLIT_REDUCTIONS,
    SPLIT_SUMS,
    GemvTuning,
    _sum_partials,
    lora_expand_triton,
    lora_shrink_triton,
    shrink_split_k,
    shrink_tiles,
)

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}

# Each case: per-token slots (-1 = base model), per-slot real ranks, r_max, slice widths, in.
CASES = {
    # one token per sequence, many adapters of mixed rank: the decode (no tl.dot) path
    "decode_one_token_per_segment": dict(
        slots=[3, 0, 5, 1, -1, 4, 2, 0, 5, 3], ranks=[1, 3, 8, 16, 64, 128], r_max=128,
        widths=(24,), in_features=64, empty_segments=2,
    ),
    # ragged short segments with base-only tokens and unequal qkv slices (q 32, k 8, v 8)
    "ragged_short_qkv": dict(
        slots=[2, 2, -1, 0, 2, 1, 1, 1, 1, 1, -1, 0, 2, 2], ranks=[3, 16, 8], r_max=16,
        widths=(32, 8, 8), in_features=48, empty_segments=1,
    ),
    # a segment longer than a 64-row tile beside one-token ones: the tl.dot path, ranks 1..128
    "prefill_long_segment": dict(
        slots=[1] * 70 + [0, -1, 2, 3, 4, 5] + [3] * 9, ranks=[1, 3, 8, 16, 64, 128], r_max=128,
        widths=(16, 16), in_features=64, empty_segments=2,
    ),
    # segments of 9..16 rows: 16-row tensor-core tiles, slices of gate_up
    "medium_segments": dict(
        slots=[0] * 12 + [1] * 9 + [-1] * 2 + [2] * 3, ranks=[8, 16, 3], r_max=16,
        widths=(24, 24), in_features=32, empty_segments=1,
    ),
    # short segments with a rank-128 slot: too big a product for the GEMV path, 16-row dot tiles
    "short_segments_rank128": dict(
        slots=[0] * 5 + [1] * 3 + [-1], ranks=[128, 8], r_max=128,
        widths=(16,), in_features=64, empty_segments=0,
    ),
    # storage rank not a multiple of 16 and `in` not a multiple of the K tile: the masked paths
    "odd_r_max": dict(
        slots=[1, 0, 0, 2, -1, 1, 1, 2], ranks=[3, 12, 8], r_max=12,
        widths=(40, 8), in_features=40, empty_segments=0,
    ),
}


def _case_inputs(case: dict, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_tokens = len(case["slots"])
    num_slices = len(case["widths"])
    max_loras = len(case["ranks"])
    x = randn(num_tokens, case["in_features"], dtype=dtype, gen=gen)
    a_stack = randn(num_slices, max_loras, case["r_max"], case["in_features"], dtype=dtype, gen=gen, scale=0.2)
    out_total = sum(case["widths"])
    b_stack = randn(max_loras, out_total, case["r_max"], dtype=dtype, gen=gen, scale=0.2)
    scaling = (torch.rand(num_slices, max_loras, generator=gen) + 0.5).float()
    # storage past each slot's real rank is padding with unspecified contents: make it NaN, so a
    # kernel that lets it into a result fails
    for slot, rank in enumerate(case["ranks"]):
        a_stack[:, slot, rank:] = float("nan")
        b_stack[slot, :, rank:] = float("nan")
    meta = make_meta(case["slots"], case["ranks"], case["empty_segments"])
    offsets = [0]
    for w in case["widths"]:
        offsets.append(offsets[-1] + w)
    return gen, x, a_stack, b_stack, scaling, tuple(offsets), meta


def _defined_mask(meta, num_slices: int, r_max: int) -> torch.Tensor:
    """Entries of the shrink output the contract defines: LoRA rows, columns below the slot's rank."""
    mask = torch.zeros(num_slices, meta.num_tokens, r_max, dtype=torch.bool)
    for g, slot in enumerate(meta.seg_slot_host):
        lo, hi = meta.seg_starts_host[g], meta.seg_starts_host[g + 1]
        if slot >= 0 and hi > lo:
            mask[:, lo:hi, : meta.slot_rank_host[slot]] = True
    return mask


def _seed(name: str, dtype: torch.dtype, salt: int) -> int:
    return (sum(map(ord, name)) * 31 + (7 if dtype == torch.float16 else 0) + salt * 1009) % (2**31)


@pytest.mark.parametrize("gemv", list(SHRINK_VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_shrink_matches_reference(name, dtype, gemv):
    """Every decode-shaped reduction (the lab times each on a GPU) on every case."""
    case = CASES[name]
    _, x, a_stack, _, _, _, meta = _case_inputs(case, dtype, _seed(name, dtype, 1 + len(gemv)))
    shape = (len(case["widths"]), meta.num_tokens, case["r_max"])
    out = torch.full(shape, float("nan"))
    ref = torch.full(shape, float("nan"))
    lora_shrink_triton(x, a_stack, meta, out, gemv=gemv)
    lora_shrink_ref(x, a_stack, meta, ref)
    defined = _defined_mask(meta, shape[0], shape[2])
    assert defined.any()
    assert not out[defined].isnan().any(), "shrink left defined entries unwritten"
    assert rel_err(out[defined], ref[defined]) < TOL[torch.float32]


@pytest.mark.parametrize("reduction", SPLIT_REDUCTIONS)
@pytest.mark.parametrize("gemv", list(SHRINK_VARIANTS))
@pytest.mark.parametrize("name,split_k", [("ragged_short_qkv", 2), ("ragged_short_qkv", 3), ("medium_segments", 2)])
def test_shrink_split_k_accumulates_all_splits(name, split_k, gemv, reduction):
    """The split-K path forced on small problems, both tile shapes, both ways of combining the
    splits: one partial output per split, summed into the first in split order, or atomics into
    one zeroed output. ``in`` 160 is 5 blocks of 32 (uneven splits) or 2.5 of 64 (a masked last
    block); for the decode "dot" tiles (256 wide) ``in`` 640 is 2.5 blocks."""
    in_features = 640 if gemv == "dot" else 160
    case = dict(CASES[name], in_features=in_features)
    _, x, a_stack, _, _, _, meta = _case_inputs(case, torch.float32, 77 + split_k + len(name) + 3 * len(gemv))
    num_slices = len(case["widths"])
    shape = (num_slices, meta.num_tokens, case["r_max"])
    out, ref = torch.full((4, *shape), float("nan")), torch.full(shape, float("nan"))
    assert shrink_split_k(in_features, num_slices, meta, 4, split_k=split_k, gemv=gemv,
                          split_reduction=reduction) == split_k
    result = lora_shrink_triton(x, a_stack, meta, out, split_k=split_k, gemv=gemv, split_reduction=reduction)
    lora_shrink_ref(x, a_stack, meta, ref)
    assert result.shape == shape and result.data_ptr() == out.data_ptr()  # the scratch's first partial
    defined = _defined_mask(meta, num_slices, case["r_max"])
    assert not result[defined].isnan().any()
    assert rel_err(result[defined], ref[defined]) < TOL[torch.float32]
    if reduction == "partials":  # every split wrote its own partial (and the sum is theirs, in order)
        assert not out[1:split_k][:, defined].isnan().any()
        assert out[split_k:].isnan().all()


@pytest.mark.parametrize("r_max", [16, 12])
def test_partials_are_summed_in_split_order(r_max):
    """The sum of the K splits' partials is ``((p0 + p1) + p2) + ...`` exactly (fp32, every run
    alike), against torch adding the same partials in that order; a rank not a power of two masks."""
    gen = torch.Generator().manual_seed(321 + r_max)
    partials = torch.randn(5, 2, 9, r_max, generator=gen) * torch.logspace(-3, 3, r_max)  # rounding matters
    want = partials[0].clone()
    for p in partials[1:]:
        want += p
    got = partials.clone()
    _sum_partials(got)
    assert torch.equal(got[0], want)
    assert torch.equal(got[1:], partials[1:])


def test_shrink_refuses_more_splits_than_the_scratch_holds():
    case = dict(CASES["ragged_short_qkv"], in_features=160)
    _, x, a_stack, _, _, _, meta = _case_inputs(case, torch.float32, 4711)
    out = torch.full((2, 3, meta.num_tokens, case["r_max"]), float("nan"))
    with pytest.raises(ValueError, match="3 K splits"):
        lora_shrink_triton(x, a_stack, meta, out, split_k=3)
    assert out.isnan().all()  # nothing launched
    # chosen by the work present (here: many K blocks, few programs), the split is capped at
    # what the scratch holds
    case = dict(case, in_features=2048)
    _, x, a_stack, _, _, _, meta = _case_inputs(case, torch.float32, 4712)
    tuning = GemvTuning(shrink_programs=4096)
    assert shrink_split_k(2048, 3, meta, 64, tuning=tuning) > 2
    assert shrink_split_k(2048, 3, meta, 2, tuning=tuning) == 2
    ref = torch.full(out.shape[1:], float("nan"))
    lora_shrink_ref(x, a_stack, meta, ref)
    result = lora_shrink_triton(x, a_stack, meta, out, tuning=tuning)
    defined = _defined_mask(meta, 3, case["r_max"])
    assert not out[1][defined].isnan().any()  # the second partial was used
    assert rel_err(result[defined], ref[defined]) < TOL[torch.float32]


@pytest.mark.parametrize("gemv", EXPAND_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_expand_matches_reference(name, dtype, gemv):
    case = CASES[name]
    gen, _, _, b_stack, scaling, offsets, meta = _case_inputs(case, dtype, _seed(name, dtype, 2 + len(gemv)))
    num_slices = len(case["widths"])
    defined = _defined_mask(meta, num_slices, case["r_max"])
    # undefined shrink entries are NaN: expand must never let them into y
    shrunk = torch.randn(num_slices, meta.num_tokens, case["r_max"], generator=gen).masked_fill(~defined, float("nan"))
    y0 = randn(meta.num_tokens, offsets[-1], dtype=dtype, gen=gen)
    y, y_ref = y0.clone(), y0.clone()
    lora_expand_triton(shrunk, b_stack, scaling, offsets, meta, y, gemv=gemv)
    lora_expand_ref(shrunk, b_stack, scaling, offsets, meta, y_ref)
    assert not y.isnan().any()
    base_rows = torch.tensor([s < 0 for s in case["slots"]])
    assert torch.equal(y[base_rows], y0[base_rows]), "base-only rows must be left untouched"
    assert rel_err(y - y0, y_ref - y0) < TOL[dtype] * 3


@pytest.mark.parametrize("gemv", ["rows", "tiled", "rows_ahead"])
@pytest.mark.parametrize("n_tiles", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tiled_expand_walks_column_tiles(dtype, n_tiles, gemv):
    """The decode-shaped expands with several column tiles per program: rank 128 in two-token
    segments makes 16-column ("tiled") or 32-column ("rows") tiles, so slices of 80 and 48 columns
    take several tiles, and with 2 or 3 tiles per program a slice's last program runs a part of
    its run."""
    case = dict(slots=[0, 1, 1, -1, 2, 0, 2], ranks=[128, 5, 16], r_max=128, widths=(80, 48), in_features=32,
                empty_segments=1)
    gen, _, _, b_stack, scaling, offsets, meta = _case_inputs(case, dtype, 31 * n_tiles + (7 if dtype == torch.float16 else 0) + len(gemv))
    defined = _defined_mask(meta, 2, case["r_max"])
    shrunk = torch.randn(2, meta.num_tokens, case["r_max"], generator=gen).masked_fill(~defined, float("nan"))
    y0 = randn(meta.num_tokens, offsets[-1], dtype=dtype, gen=gen)
    y, y_ref = y0.clone(), y0.clone()
    lora_expand_triton(shrunk, b_stack, scaling, offsets, meta, y, gemv=gemv, n_tiles=n_tiles)
    lora_expand_ref(shrunk, b_stack, scaling, offsets, meta, y_ref)
    assert not y.isnan().any()
    base_rows = torch.tensor([s < 0 for s in case["slots"]])
    assert torch.equal(y[base_rows], y0[base_rows])
    assert rel_err(y - y0, y_ref - y0) < TOL[dtype] * 3


def test_shrink_then_expand_equals_dense_lora():
    """The two kernels chained reproduce y + scaling * x @ A.T @ B.T per token (independent of lora_ref)."""
    case = CASES["ragged_short_qkv"]
    case = dict(case, in_features=160)  # 5 K blocks of 32: the shrink splits three ways
    _, x, a_stack, b_stack, scaling, offsets, meta = _case_inputs(case, torch.float32, 4242)
    shrunk = nan_like(torch.empty(4, 3, meta.num_tokens, case["r_max"]))
    result = lora_shrink_triton(x, a_stack, meta, shrunk, split_k=3)
    y0 = torch.randn(meta.num_tokens, offsets[-1], generator=torch.Generator().manual_seed(5))
    y = y0.clone()
    lora_expand_triton(result, b_stack, scaling, offsets, meta, y)
    expected = y0.clone()
    for t, slot in enumerate(case["slots"]):
        if slot < 0:
            continue
        r = case["ranks"][slot]
        for s in range(3):
            o0, o1 = offsets[s], offsets[s + 1]
            delta = x[t] @ a_stack[s, slot, :r].t() @ b_stack[slot, o0:o1, :r].t()
            expected[t, o0:o1] += scaling[s, slot] * delta
    assert rel_err(y, expected) < 1e-5


@pytest.mark.parametrize("name,gemv", [(n, g) for n in ("ragged_short_qkv", "odd_r_max") for g in EXPAND_VARIANTS]
                         + [("short_segments_rank128", None)])
def test_expand_can_add_the_shrinks_split_partials(name, gemv):
    """split_sum "expand": in a decode-shaped step the shrink leaves its K splits' partials
    unsummed and the expand adds them as it reads each row, in split order. y is bit-equal to the
    one after the separate sum launch (the same fp32 additions in the same order) and matches the
    reference; the scratch's unused partials are NaN, so an expand reading past the splits would
    fail. Every decode-shaped expand, and the tensor-core one ("dot", and rank 128's fallback),
    with even and masked rank chunks."""
    case = dict(CASES[name], in_features=640)
    _, x, a_stack, b_stack, scaling, offsets, meta = _case_inputs(case, torch.float32, 909 + len(name) + len(gemv or ""))
    num_slices = len(case["widths"])
    y0 = torch.randn(meta.num_tokens, offsets[-1], generator=torch.Generator().manual_seed(3 + len(gemv or "")))
    ys = {}
    for split_sum in SPLIT_SUMS:
        tuning = GemvTuning(split_sum=split_sum)
        scratch = torch.full((4, num_slices, meta.num_tokens, case["r_max"]), float("nan"))
        result = lora_shrink_triton(x, a_stack, meta, scratch, split_k=3, tuning=tuning)
        assert result.shape[0] == (3 if split_sum == "expand" else num_slices)  # 3 partials, or their sum
        ys[split_sum] = y0.clone()
        lora_expand_triton(result, b_stack, scaling, offsets, meta, ys[split_sum], gemv=gemv, tuning=tuning)
    assert torch.equal(ys["expand"], ys["launch"])
    shrunk_ref = torch.full((num_slices, meta.num_tokens, case["r_max"]), float("nan"))
    lora_shrink_ref(x, a_stack, meta, shrunk_ref)
    y_ref = y0.clone()
    lora_expand_ref(shrunk_ref, b_stack, scaling, offsets, meta, y_ref)
    assert rel_err(ys["expand"] - y0, y_ref - y0) < TOL[torch.float32] * 3


@pytest.mark.parametrize("stage_elements", [4096, 32768])
def test_the_dot_shrinks_k_tile_follows_the_tuning(stage_elements):
    """The decode "dot" shrink's K tile comes from the tuning's elements per pipeline stage (128
    and 1024 wide at rank 16 here, against 256 by default); either way it reads every K block,
    the last one masked (``in`` 1600 is 12.5 blocks of 128, 1.6 of 1024)."""
    case = dict(CASES["ragged_short_qkv"], in_features=1600)
    _, x, a_stack, _, _, _, meta = _case_inputs(case, torch.float32, 61 + stage_elements)
    tuning = GemvTuning(shrink_gemv=("dot",) * 4, shrink_dot_stage_elements=stage_elements, shrink_dot_num_stages=2)
    shape = (len(case["widths"]), meta.num_tokens, case["r_max"])
    out, ref = torch.full((4, *shape), float("nan")), torch.full(shape, float("nan"))
    result = lora_shrink_triton(x, a_stack, meta, out, tuning=tuning)
    lora_shrink_ref(x, a_stack, meta, ref)
    defined = _defined_mask(meta, shape[0], shape[2])
    assert rel_err(result[defined], ref[defined]) < TOL[torch.float32]
    assert shrink_tiles(meta.max_seg_len, meta.max_rank, "dot", 4096, stage_elements)["BLOCK_K"] == stage_elements // 32


@pytest.mark.parametrize("name", ["medium_segments", "prefill_long_segment"])
def test_longer_segments_keep_the_sum_launch(name):
    """Past the decode shapes the partials are summed by their own launch whatever the tuning
    says (the tensor-core expand would lose its pipelined loads): the shrink returns their sum."""
    case = dict(CASES[name], in_features=640)
    _, x, a_stack, _, _, _, meta = _case_inputs(case, torch.float32, 5150 + len(name))
    num_slices = len(case["widths"])
    scratch = torch.full((4, num_slices, meta.num_tokens, case["r_max"]), float("nan"))
    result = lora_shrink_triton(x, a_stack, meta, scratch, split_k=3, tuning=GemvTuning(split_sum="expand"))
    ref = torch.full(result.shape, float("nan"))
    lora_shrink_ref(x, a_stack, meta, ref)
    defined = _defined_mask(meta, num_slices, case["r_max"])
    assert result.shape == (num_slices, meta.num_tokens, case["r_max"])
    assert rel_err(result[defined], ref[defined]) < TOL[torch.float32]


def test_no_lora_segments_is_a_no_op():
    meta = make_meta([-1, -1, -1], [8, 8])
    x = torch.randn(3, 16)
    out = torch.full((1, 3, 8), float("nan"))
    lora_shrink_triton(x, torch.randn(1, 2, 8, 16), meta, out)
    assert out.isnan().all()
    y0 = torch.randn(3, 8)
    y = y0.clone()
    lora_expand_triton(out, torch.randn(2, 8, 8), torch.ones(1, 2), (0, 8), meta, y)
    assert torch.equal(y, y0)


def test_projection_ranks_override_the_steps_ranks():
    """``slot_rank=`` (a projection's own ranks, LoRAStack.rank) bounds what both kernels read:
    weights past it are NaN here, and a slot with rank 0 for this projection adds nothing."""
    case = CASES["ragged_short_qkv"]  # step ranks [3, 16, 8]
    _, x, a_stack, b_stack, scaling, offsets, meta = _case_inputs(case, torch.float32, 9191)
    projection_rank = [2, 0, 5]
    for slot, rank in enumerate(projection_rank):
        a_stack[:, slot, rank:] = float("nan")
        b_stack[slot, :, rank:] = float("nan")
    override = torch.tensor(projection_rank, dtype=torch.int32)
    shrunk = nan_like(torch.empty(3, meta.num_tokens, case["r_max"]))
    lora_shrink_triton(x, a_stack, meta, shrunk, slot_rank=override)
    y0 = torch.randn(meta.num_tokens, offsets[-1], generator=torch.Generator().manual_seed(6))
    y = y0.clone()
    lora_expand_triton(shrunk, b_stack, scaling, offsets, meta, y, slot_rank=override)
    expected = y0.clone()
    for t, slot in enumerate(case["slots"]):
        r = projection_rank[slot] if slot >= 0 else 0
        for s in range(3):
            o0, o1 = offsets[s], offsets[s + 1]
            if r:
                delta = x[t] @ a_stack[s, slot, :r].t() @ b_stack[slot, o0:o1, :r].t()
                expected[t, o0:o1] += scaling[s, slot] * delta
    assert not y.isnan().any()
    assert rel_err(y, expected) < 1e-5


def test_padded_metadata_with_a_sizing_hint_launches_like_the_exact_one():
    """A CUDA graph's metadata lists spare empty segments (an upper bound); ``sizing_segments``
    gives the K split the exact metadata would get, and the result is the same."""
    case = dict(CASES["ragged_short_qkv"], in_features=2048)  # 3 adapters, many K blocks
    _, x, a_stack, _, _, _, meta = _case_inputs(case, torch.float32, 8080)
    num_slices, spare = 3, 9
    padded = padded_like_a_graph(meta, meta.num_segments + spare, sizing=False)
    tuning = GemvTuning(shrink_programs=8 * meta.num_segments * num_slices)  # the exact meta splits 8 ways
    hinted_meta = padded_like_a_graph(meta, meta.num_segments + spare, sizing=True)
    splits = [shrink_split_k(2048, num_slices, m, 32, tuning=tuning) for m in (meta, padded, hinted_meta)]
    assert splits[0] == splits[2] == 8 and splits[1] < 8
    ref = torch.full((num_slices, meta.num_tokens, case["r_max"]), float("nan"))
    lora_shrink_ref(x, a_stack, meta, ref)
    defined = _defined_mask(meta, num_slices, case["r_max"])
    for m in (meta, padded, hinted_meta):
        result = lora_shrink_triton(x, a_stack, m, torch.full((32, *ref.shape), float("nan")), tuning=tuning)
        assert rel_err(result[defined], ref[defined]) < TOL[torch.float32]


class _LaunchRecorder:
    """Stands in for a Triton kernel: records each launch's keyword arguments (the constexprs),
    then launches the real kernel."""

    def __init__(self, kernel, launches: list[dict]):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_the_tuning_names_the_decode_variant_of_each_segment_class(monkeypatch):
    """``GemvTuning.shrink_gemv`` / ``expand_gemv`` pick the decode-shaped variant by the step's
    longest segment (classes 1, 2, 4, 8), also when installed as ``DEFAULT_TUNING`` (as the GPU
    check's ``--tune-lora`` does), and every choice still matches the reference."""
    from loraplex.kernels import triton_lora

    tuning = GemvTuning(shrink_gemv=("rows_x_rank", "acc", "dot", "reduce"), expand_gemv=("rows", "tiled", "dot", "plain"))
    shrinks, expands = [], []
    monkeypatch.setattr(triton_lora, "_sgmv_shrink_kernel", _LaunchRecorder(triton_lora._sgmv_shrink_kernel, shrinks))
    monkeypatch.setattr(triton_lora, "_sgmv_expand_kernel", _LaunchRecorder(triton_lora._sgmv_expand_kernel, expands))
    monkeypatch.setattr(triton_lora, "_sgmv_expand_gemv_kernel",
                        _LaunchRecorder(triton_lora._sgmv_expand_gemv_kernel, expands))
    # (longest segment, what the shrink launch and the expand launch must be)
    expected = {
        1: (dict(USE_DOT=False, GEMV=SHRINK_VARIANTS["rows_x_rank"]), dict(ROWS=True)),
        2: (dict(USE_DOT=False, GEMV=SHRINK_VARIANTS["acc"]), dict(ROWS=False)),
        3: (dict(USE_DOT=True, BLOCK_M=16), dict(USE_DOT=True, BLOCK_M=16)),
        6: (dict(USE_DOT=False, GEMV=SHRINK_VARIANTS["reduce"]), dict(USE_DOT=False, BLOCK_M=8)),
    }
    for installed in (False, True):
        if installed:
            monkeypatch.setattr(triton_lora, "DEFAULT_TUNING", tuning)
        for longest, (shrink_kw, expand_kw) in expected.items():
            case = dict(slots=[0] * longest + [1, -1, 2], ranks=[16, 8, 3], r_max=16, widths=(24, 8),
                        in_features=64, empty_segments=1)
            _, x, a_stack, b_stack, scaling, offsets, meta = _case_inputs(case, torch.float32, 97 * longest + installed)
            assert meta.max_seg_len == longest
            kwargs = {} if installed else dict(tuning=tuning)
            shrinks.clear(), expands.clear()
            result = lora_shrink_triton(x, a_stack, meta, nan_like(torch.empty(4, 2, meta.num_tokens, 16)), **kwargs)
            y0 = torch.randn(meta.num_tokens, offsets[-1], generator=torch.Generator().manual_seed(longest))
            y = y0.clone()
            lora_expand_triton(result, b_stack, scaling, offsets, meta, y, **kwargs)
            assert all(shrinks[0][k] == v for k, v in shrink_kw.items()), (longest, shrinks[0])
            assert all(expands[0][k] == v for k, v in expand_kw.items()), (longest, expands[0])
            ref = torch.full((2, meta.num_tokens, 16), float("nan"))
            lora_shrink_ref(x, a_stack, meta, ref)
            defined = _defined_mask(meta, 2, 16)
            assert rel_err(result[defined], ref[defined]) < TOL[torch.float32]
            y_ref = y0.clone()
            lora_expand_ref(ref.nan_to_num(), b_stack, scaling, offsets, meta, y_ref)
            assert rel_err(y - y0, y_ref - y0) < 1e-4


@pytest.mark.parametrize("field, value", [("shrink_gemv", ("rows_x_rank",) * 3), ("shrink_gemv", ("rows",) * 4),
                                          ("expand_gemv", ("rows", "rows", "rows", "acc")), ("split_sum", "shrink")])
def test_a_tuning_naming_an_unknown_variant_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        GemvTuning(**{field: value})
