"""KV sizing of a model with layer groups (kv_layout): a page holds a block for ``group_size``
layers, so the same bytes make ``num_layers / group_size`` times the pages of a one-group model;
layers at the same position of different groups share a storage tensor; the context is lowered
only to the longest whose peak pages fit (global groups: the whole context, windowed ones: the
window and a chunk), and a requested one that does not fit is refused."""

from __future__ import annotations

import pytest

from loraplex.config import EngineConfig
from loraplex.engine.model_runner import ModelRunner
from loraplex.model.config import ModelSpec
from tests.fixtures.tiny_models import make_tiny_model_dir

S, F = "sliding_attention", "full_attention"
LAYERS = [S, S, F, S, S, F, S, S, F, S, S]  # 3 global, 8 windowed: groups of 3, one padded
BLOCK, WINDOW = 4, 10


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("gemma3-sizing"), "gemma3", seed=1, sliding_window=WINDOW,
                               num_hidden_layers=len(LAYERS), layer_types=LAYERS)


def _runner(model_dir, home, **options) -> ModelRunner:
    return ModelRunner(EngineConfig(**{"model": str(model_dir), "home": home, "block_size": BLOCK, **options}))


def _page_bytes(model_dir) -> int:  # 3 layers' K and V for one block, float32
    spec = ModelSpec.from_dir(model_dir)
    return 2 * 3 * spec.num_kv_heads * spec.head_dim * 4 * BLOCK


def test_pages_hold_a_group_of_layers_and_share_storage(gemma3_dir, loraplex_home):
    runner = _runner(gemma3_dir, loraplex_home, kv_cache_bytes=2_000_000, max_model_len=256)
    layout = runner.kv_layout
    assert layout.group_size == 3 and layout.group_windows == (None, WINDOW, WINDOW, WINDOW)
    assert runner.num_blocks == 2_000_000 // _page_bytes(gemma3_dir)
    assert len(runner.kv_storage) == 3 and len(runner.kv_caches) == len(LAYERS)
    for layer, cache in enumerate(runner.kv_caches):
        assert cache is runner.kv_storage[layout.layer_slot[layer]]
        assert cache.shape == (2, runner.num_blocks, BLOCK, runner.spec.num_kv_heads, runner.spec.head_dim)
    # the global layers are one group, each at its own slot
    global_layers = [i for i, t in enumerate(LAYERS) if t == F]
    assert sorted(layout.layer_slot[i] for i in global_layers) == [0, 1, 2]
    assert len({layout.layer_group[i] for i in global_layers}) == 1


@pytest.mark.parametrize("chunked", [True, False])
def test_context_lowered_to_the_longest_that_fits(gemma3_dir, loraplex_home, chunked):
    chunk = 16
    num_pages = 40
    runner = _runner(gemma3_dir, loraplex_home, kv_cache_bytes=num_pages * _page_bytes(gemma3_dir),
                     max_num_batched_tokens=chunk, enable_chunked_prefill=chunked, max_num_seqs=1)
    assert runner.num_blocks == num_pages

    def peak(length: int) -> int:  # 1 global group, 3 windowed groups
        whole = -(-length // BLOCK)
        windowed = min(whole, -(-(WINDOW - 1 + chunk) // BLOCK) + 1) if chunked else whole
        return whole + 3 * windowed

    want = max(n for n in range(1025) if peak(n) <= num_pages)
    assert runner.max_model_len == want
    # with chunks the windowed groups hold 8 pages each (a window and a chunk), the global one
    # the rest; without, every group holds the whole context
    assert want == ((num_pages - 3 * 8) * BLOCK if chunked else num_pages // 4 * BLOCK)
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        _runner(gemma3_dir, loraplex_home, kv_cache_bytes=num_pages * _page_bytes(gemma3_dir), max_model_len=want + 1,
                max_num_batched_tokens=chunk, enable_chunked_prefill=chunked, max_num_seqs=1)
