"""Qwen2 / Qwen3 ``use_sliding_window`` configs read as transformers reads them: per layer, the
window transformers' attention masks with (``Qwen2Config`` / ``Qwen3Config`` derive
``layer_types`` from ``max_window_layers``, or take it as given), and the configs transformers
itself cannot run (a sliding layer without a window) refused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

from loraplex.model.config import ModelSpec, UnsupportedModelError

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
KINDS = [("Qwen2ForCausalLM", Qwen2Config), ("Qwen3ForCausalLM", Qwen3Config)]
S, F = "sliding_attention", "full_attention"
CASES = [
    {},  # the flag off: no window whatever the rest says
    dict(sliding_window=16, max_window_layers=2),
    dict(use_sliding_window=True, sliding_window=16, max_window_layers=2),
    dict(use_sliding_window=True, sliding_window=16, max_window_layers=0),  # every layer windowed
    dict(use_sliding_window=True, sliding_window=16, max_window_layers=5),  # none
    dict(use_sliding_window=True, sliding_window=16, max_window_layers=9),
    dict(use_sliding_window=True, sliding_window=1, max_window_layers=4),
    dict(use_sliding_window=True, max_window_layers=3),  # transformers' default window, 4096
    dict(use_sliding_window=True, sliding_window=16),  # transformers' default max_window_layers, 28
    dict(use_sliding_window=True, sliding_window=None, max_window_layers=1),
    dict(use_sliding_window=True, sliding_window=16, layer_types=[S, F, S, S, F]),
    dict(use_sliding_window=True, sliding_window=16, max_window_layers=0, layer_types=[F] * 5),
]


def hf_windows(hf) -> list[int | None]:
    return [hf.sliding_window if t == S else None for t in hf.layer_types]


@pytest.mark.parametrize("keys", CASES)
@pytest.mark.parametrize("arch, hf_class", KINDS)
def test_layer_windows_are_transformers(arch, hf_class, keys):
    spec = ModelSpec.from_dict({"architectures": [arch], **SHAPE, **keys})
    want = hf_windows(hf_class(**SHAPE, **keys))
    # a window no served context reaches is the whole context (4096 > 256 positions)
    want = [w if w is not None and w < SHAPE["max_position_embeddings"] else None for w in want]
    assert list(spec.layer_windows) == want
    windowed = {w for w in want if w is not None}
    assert spec.uniform_sliding_window == (windowed.pop() if None not in want else None)


def test_config_json_written_by_transformers_reads_back(tmp_path):
    """What save_pretrained writes (the window, max_window_layers and the derived layer_types)."""
    hf = Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=12, max_window_layers=3)
    hf.architectures = ["Qwen2ForCausalLM"]
    hf.save_pretrained(tmp_path)
    assert list(ModelSpec.from_dir(tmp_path).layer_windows) == hf_windows(hf) == [None] * 3 + [12] * 2


@pytest.mark.parametrize("keys", [
    dict(use_sliding_window=False, sliding_window=16, layer_types=[S, F, F, F, F]),
    dict(use_sliding_window=True, sliding_window=None, layer_types=[F, F, S, F, F]),
])
@pytest.mark.parametrize("arch, hf_class", KINDS)
def test_sliding_layer_without_window_is_refused_as_transformers_refuses_it(arch, hf_class, keys):
    with pytest.raises(UnsupportedModelError, match="no window"):
        ModelSpec.from_dict({"architectures": [arch], **SHAPE, **keys})
    hf = hf_class(**{**SHAPE, "num_hidden_layers": 5}, **keys)
    model = AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
    with pytest.raises(ValueError, match="sliding_window"):
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)


@pytest.mark.parametrize("keys, match", [
    (dict(use_sliding_window=True, sliding_window=0), "sliding_window"),
    (dict(use_sliding_window=True, sliding_window=8.5), "sliding_window"),
    (dict(use_sliding_window=True, sliding_window=8, max_window_layers="2"), "max_window_layers"),
    (dict(use_sliding_window=True, sliding_window=8, layer_types=[S] * 4), "layer_types"),
])
def test_bad_window_keys_are_refused_by_name(keys, match):
    with pytest.raises(UnsupportedModelError, match=match):
        ModelSpec.from_dict({"architectures": ["Qwen2ForCausalLM"], **SHAPE, **keys})


def test_other_architectures_still_refuse_the_flag():
    with pytest.raises(UnsupportedModelError, match="sliding-window attention is not supported"):
        ModelSpec.from_dict({"architectures": ["LlamaForCausalLM"], **SHAPE, "use_sliding_window": True})
