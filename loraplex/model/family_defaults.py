"""Per-architecture defaults for config.json keys a checkpoint leaves out: transformers' config-class
defaults, which differ by family. The context (which caps ``max_model_len``), the norm epsilon
(which changes every output), the rotary base, the head size and the KV head count are read
through ``family_defaults`` by ``config.py`` and ``gemma_config.py``; tests/model/test_config_defaults.py
holds each value against the transformers class."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.model.gemma3_multimodal import GEMMA3_MULTIMODAL
from loraplex.model.moe_config import MIXTRAL, QWEN2_MOE, QWEN3_MOE
from loraplex.model.phi3 import PHI3_ARCHITECTURE


@dataclass(frozen=True)
class FamilyDefaults:
    """One family's defaults; a field left at its default here is the value most families share."""

    max_position_embeddings: int = 2048  # LlamaConfig's
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0  # transformers' ``default_theta``
    # None: hidden_size // num_attention_heads (Qwen3's and Gemma's are fixed whatever the hidden size)
    head_dim: int | None = None
    # None: one KV head per query head (also what an explicit null in config.json means)
    num_kv_heads: int | None = None


FAMILY_DEFAULTS: dict[str, FamilyDefaults] = {
    "LlamaForCausalLM": FamilyDefaults(),
    "GraniteForCausalLM": FamilyDefaults(),
    "MistralForCausalLM": FamilyDefaults(max_position_embeddings=131_072, num_kv_heads=8),
    "Qwen2ForCausalLM": FamilyDefaults(max_position_embeddings=32_768, num_kv_heads=32),
    "Qwen3ForCausalLM": FamilyDefaults(max_position_embeddings=32_768, head_dim=128, num_kv_heads=32),
    PHI3_ARCHITECTURE: FamilyDefaults(max_position_embeddings=4096, rms_norm_eps=1e-5),
    MIXTRAL: FamilyDefaults(max_position_embeddings=131_072, rms_norm_eps=1e-5, rope_theta=1_000_000.0,
                            num_kv_heads=8),
    QWEN2_MOE: FamilyDefaults(max_position_embeddings=32_768, num_kv_heads=16),
    QWEN3_MOE: FamilyDefaults(max_position_embeddings=32_768, num_kv_heads=4),
    # Gemma's rotary bases are read in gemma_config (per layer type in Gemma 3)
    "GemmaForCausalLM": FamilyDefaults(max_position_embeddings=8192, head_dim=256, num_kv_heads=16),
    "Gemma2ForCausalLM": FamilyDefaults(max_position_embeddings=8192, head_dim=256, num_kv_heads=4),
    "Gemma3ForCausalLM": FamilyDefaults(max_position_embeddings=131_072, head_dim=256, num_kv_heads=4),
    GEMMA3_MULTIMODAL: FamilyDefaults(max_position_embeddings=131_072, head_dim=256, num_kv_heads=4),
}


def family_defaults(architecture: str) -> FamilyDefaults:
    """``architecture``'s defaults (a supported one is always listed; see FAMILY_DEFAULTS)."""
    return FAMILY_DEFAULTS[architecture]
