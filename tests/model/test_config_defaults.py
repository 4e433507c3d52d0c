"""Config keys a checkpoint's config.json leaves out read as transformers' config class for that
family reads them. They differ by family: the context (``max_position_embeddings``, which caps
``max_model_len``) and the norm epsilon (which changes every output)."""

from __future__ import annotations

import pytest
import transformers

from loraplex.model.config import ModelSpec

SHAPE = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)
FAMILIES = [
    ("LlamaForCausalLM", "LlamaConfig"),
    ("MistralForCausalLM", "MistralConfig"),
    ("Qwen2ForCausalLM", "Qwen2Config"),
    ("Qwen3ForCausalLM", "Qwen3Config"),
    ("GraniteForCausalLM", "GraniteConfig"),
    ("Phi3ForCausalLM", "Phi3Config"),
    ("GemmaForCausalLM", "GemmaConfig"),
    ("Gemma2ForCausalLM", "Gemma2Config"),
    ("Gemma3ForCausalLM", "Gemma3TextConfig"),
    ("MixtralForCausalLM", "MixtralConfig"),
    ("Qwen2MoeForCausalLM", "Qwen2MoeConfig"),
    ("Qwen3MoeForCausalLM", "Qwen3MoeConfig"),
]


@pytest.mark.parametrize("arch, hf_class", FAMILIES)
def test_context_and_norm_eps_left_out_take_transformers_defaults(arch, hf_class):
    hf = getattr(transformers, hf_class)(**SHAPE)
    spec = ModelSpec.from_dict({"architectures": [arch], **SHAPE})
    assert spec.max_position_embeddings == hf.max_position_embeddings
    assert spec.rms_norm_eps == hf.rms_norm_eps
    assert spec.tie_word_embeddings == hf.tie_word_embeddings


@pytest.mark.parametrize("arch, hf_class", FAMILIES)
def test_given_keys_win_over_defaults(arch, hf_class):
    keys = dict(SHAPE, max_position_embeddings=12_345, rms_norm_eps=3e-7)
    spec = ModelSpec.from_dict({"architectures": [arch], **keys})
    hf = getattr(transformers, hf_class)(**keys)
    assert (spec.max_position_embeddings, spec.rms_norm_eps) == (hf.max_position_embeddings, hf.rms_norm_eps)


@pytest.mark.parametrize("arch, hf_class", FAMILIES)
def test_rope_theta_and_head_dim_left_out_take_transformers_defaults(arch, hf_class):
    """MixtralConfig's default_theta is 1e6 and Qwen3Config's head_dim 128 (not hidden // heads):
    a config.json without the key rotates and shapes its heads as transformers builds them."""
    hf = getattr(transformers, hf_class)(**SHAPE)
    spec = ModelSpec.from_dict({"architectures": [arch], **SHAPE})
    params = hf.rope_parameters
    # Gemma 3 keeps one rope per layer type: the global layers' is spec.rope
    assert spec.rope.theta == params.get("rope_theta", params.get("full_attention", {}).get("rope_theta"))
    assert spec.head_dim == (getattr(hf, "head_dim", None) or SHAPE["hidden_size"] // SHAPE["num_attention_heads"])


@pytest.mark.parametrize("arch, hf_class", FAMILIES)
def test_kv_heads_left_out_take_transformers_defaults(arch, hf_class):
    """num_key_value_heads left out is the config class's default (Mistral and Mixtral 8, Qwen2-MoE
    16, Qwen3-MoE 4, ...), not one KV head per query head for every family; an explicit null, where
    the config class takes one, is one per query head in both."""
    shape = {k: v for k, v in SHAPE.items() if k != "num_key_value_heads"} | dict(hidden_size=256,
                                                                                 num_attention_heads=32)
    hf = getattr(transformers, hf_class)(**shape)
    assert ModelSpec.from_dict({"architectures": [arch], **shape}).num_kv_heads == hf.num_key_value_heads
    null = dict(shape, num_key_value_heads=None)
    try:
        hf = getattr(transformers, hf_class)(**null)
    except Exception:  # noqa: BLE001 - this config class takes no null (strict int field)
        return
    if hf.num_key_value_heads is None:  # kept as null (Qwen2-MoE): transformers cannot build that model
        return
    assert ModelSpec.from_dict({"architectures": [arch], **null}).num_kv_heads == hf.num_key_value_heads == 32


def test_every_supported_architecture_has_one_row_of_defaults():
    """One table (family_defaults.FAMILY_DEFAULTS) serves every family: a supported architecture
    without a row would fail on its first config.json instead of at review."""
    from loraplex.model.config import SUPPORTED_ARCHITECTURES
    from loraplex.model.family_defaults import FAMILY_DEFAULTS

    assert set(FAMILY_DEFAULTS) == set(SUPPORTED_ARCHITECTURES)
