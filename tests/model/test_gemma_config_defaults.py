"""Gemma 2 / 3 config keys left out (or null) read as transformers' config classes read them:
``Gemma2Config`` and ``Gemma3TextConfig`` fill in a 4096-position window on their default
layer pattern, and Gemma 2's soft-caps of 50 (attention) and 30 (final logits)."""

from __future__ import annotations

import pytest
from transformers import Gemma2Config, Gemma3TextConfig

from loraplex.model.config import ModelSpec

SHAPE = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32)
KINDS = [("Gemma2ForCausalLM", Gemma2Config), ("Gemma3ForCausalLM", Gemma3TextConfig)]


@pytest.mark.parametrize("arch, hf_class", KINDS)
def test_keys_left_out_take_transformers_defaults(arch, hf_class):
    spec = ModelSpec.from_dict({"architectures": [arch], **SHAPE}).gemma
    hf = hf_class(**SHAPE)
    assert spec.sliding_window == hf.sliding_window
    assert spec.layer_types == tuple(hf.layer_types)
    windows = [hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types]
    assert [spec.layer_window(i) for i in range(SHAPE["num_hidden_layers"])] == windows
    assert (spec.attn_logit_softcap, spec.final_logit_softcap) == (hf.attn_logit_softcapping,
                                                                   hf.final_logit_softcapping)


def test_gemma3_without_a_window_keeps_the_local_rope_on_its_sliding_layers():
    """transformers picks each layer's rope by its layer type, window or not."""
    keys = dict(SHAPE, sliding_window=None, rope_local_base_freq=10_000.0, rope_theta=1_000_000.0)
    spec = ModelSpec.from_dict({"architectures": ["Gemma3ForCausalLM"], **keys}).gemma
    hf = Gemma3TextConfig(**keys)
    assert spec.layer_types == tuple(hf.layer_types) and "sliding_attention" in spec.layer_types
    assert all(spec.layer_window(i) is None for i in range(SHAPE["num_hidden_layers"]))
    assert spec.rope_local.theta == hf.rope_parameters["sliding_attention"]["rope_theta"]
