"""A cache slot that no real query of a row may attend holds whatever its block's last owner
left, NaN included (an adapter whose update overflowed writes NaN K/V, and its blocks go to the
next request). The CPU path pads each group's keys to its longest sequence and masks them:
every slot nobody wrote is NaN here, in every block (each sequence's last block past its length,
the blocks no one owns, the table's padding entries), and each case must answer as the
reference, which reads only the keys each query attends, and without a NaN."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.attention_cpu import paged_attention_cpu
from loraplex.kernels.attention_ref import paged_attention_ref
from tests.kernels.test_triton_attention import _build_batch

CASES = {
    # (cached prefix, query tokens) per sequence; ragged lengths so that rows pad past their own
    "decodes": dict(seqs=[(40, 1), (3, 1), (17, 1), (100, 1), (0, 1)], block_size=16),
    "prefill_chunks": dict(seqs=[(0, 23), (40, 9), (5, 3), (31, 33), (0, 2)], block_size=16),
    "mixed": dict(seqs=[(17, 1), (0, 23), (40, 9), (5, 1), (63, 1), (31, 33)], block_size=32),
    "window": dict(seqs=[(70, 1), (9, 1), (33, 20), (130, 3), (0, 9)], block_size=16, window=24),
    "window_softcap": dict(seqs=[(90, 1), (61, 25), (21, 2), (4, 1)], block_size=8, window=20, softcap=2.0),
    "softcap": dict(seqs=[(50, 1), (12, 7), (3, 1)], block_size=16, softcap=5.0),
}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("name", list(CASES))
def test_nan_in_slots_no_query_attends_does_not_reach_the_output(name, dtype, tol):
    case = CASES[name]
    seed = sum(map(ord, name)) + (dtype == torch.bfloat16)
    batch = _build_batch(case["seqs"], 6, 2, 16, case["block_size"], dtype, seed)  # unwritten slots NaN
    assert batch["kv_cache"].isnan().any()
    options = dict(sliding_window=case.get("window"), softcap=case.get("softcap"))
    got = paged_attention_cpu(**batch, **options)
    assert not got.isnan().any(), "a stale (NaN) slot reached a row"
    want = paged_attention_ref(**batch, **options)
    assert not want.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
