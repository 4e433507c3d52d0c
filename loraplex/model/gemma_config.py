"""Gemma's config keys (Gemma 1, Gemma 2, Gemma 3 text) read into ``ModelSpec`` fields.

Where Gemma departs from Llama: RMSNorm scales by ``1 + w`` in fp32, the MLP is GeGLU (gelu
with the tanh approximation), the embeddings are multiplied by ``sqrt(hidden_size)`` rounded to
the model dtype, and the head is tied by default. Gemma 2 and 3 add a norm on each sub-layer's
output, a softmax scale of ``query_pre_attn_scalar ** -0.5`` and sliding-window attention on
the layers ``layer_types`` names (Gemma 2: every other one; Gemma 3: five of six). Gemma 2
soft-caps attention and final logits; Gemma 3 norms q and k per head and gives its windowed
layers their own rope base (``rope_local_base_freq``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from loraplex.model.config import RopeConfig, UnsupportedModelError, common_spec_fields, parse_rope
from loraplex.model.family_defaults import family_defaults

# Gemma3ForConditionalGeneration: its text model (gemma3_multimodal.gemma3_text_config)
GEMMA_VERSIONS = {"GemmaForCausalLM": 1, "Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 3, "Gemma3ForConditionalGeneration": 3}
# transformers' names for gelu with the tanh approximation (ACT2FN), and the exact one
GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu_fast": "tanh", "gelu": "none"}
SLIDING, FULL = "sliding_attention", "full_attention"
# What transformers' Gemma2Config / Gemma3TextConfig take for a key a config.json leaves out (an
# explicit null there means none): the window, and (attention, final logit) soft-caps by version
DEFAULT_SLIDING_WINDOW = 4096
SOFTCAP_DEFAULTS: dict[int, tuple[float | None, float | None]] = {1: (None, None), 2: (50.0, 30.0), 3: (None, None)}


@dataclass(frozen=True)
class GemmaSpec:
    """What a Gemma checkpoint needs beyond the Llama fields of ``ModelSpec``."""

    version: int  # 1, 2 or 3
    gelu_approximate: str  # "tanh" (gelu_pytorch_tanh, every published Gemma) or "none"
    sliding_window: int | None = None  # span of the windowed layers
    layer_types: tuple[str, ...] = ()  # per layer SLIDING or FULL; () = all full
    attn_logit_softcap: float | None = None  # scores -> tanh(s / cap) * cap (Gemma 2; Gemma 3: null)
    final_logit_softcap: float | None = None  # logits -> tanh(l / cap) * cap (likewise)
    rope_local: RopeConfig | None = None  # Gemma 3: the windowed layers' rope; None = the global one

    @property
    def sandwich_norms(self) -> bool:
        """Gemma 2 and 3 norm each sub-layer's output before its residual add, and the MLP input
        with ``pre_feedforward_layernorm`` (``post_attention_layernorm`` norms the attention's output)."""
        return self.version >= 2

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, or None for global attention."""
        if self.sliding_window is None or not self.layer_types or self.layer_types[layer] != SLIDING:
            return None
        return self.sliding_window


def _positive(cfg: dict[str, Any], key: str, arch: str, default: float | None = None) -> float | None:
    value = cfg.get(key, default)  # a key left out takes ``default``; an explicit null means none
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise UnsupportedModelError(f"{arch}: {key} must be a positive number or null, got {value!r}")
    return float(value)


def _layer_types(cfg: dict[str, Any], version: int, num_layers: int, arch: str) -> tuple[str, ...]:
    """``layer_types`` as given, or transformers' default pattern for configs without it."""
    given = cfg.get("layer_types")
    if given is None:
        if version == 1:
            return ()
        # Gemma 2: layers 0, 2, 4, ... are windowed; Gemma 3: all but every sixth
        pattern = 2 if version == 2 else int(cfg.get("sliding_window_pattern") or 6)
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
    types = tuple(given)
    if len(types) != num_layers or not set(types) <= {SLIDING, FULL}:
        raise UnsupportedModelError(
            f"{arch}: layer_types must name {SLIDING!r} or {FULL!r} for each of the {num_layers} layers"
        )
    return types


def _gemma3_ropes(cfg: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """(global rope, local rope) from transformers 5's per-layer-type ``rope_parameters``, or
    from the older keys: ``rope_theta`` (1e6) with ``rope_scaling`` for the global layers and
    ``rope_local_base_freq`` (1e4) for the windowed ones."""
    params = cfg.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full = parse_rope({"rope_parameters": {"rope_theta": 1_000_000.0, **(params.get(FULL) or {})}})
        local = parse_rope({"rope_parameters": {"rope_theta": 10_000.0, **(params.get(SLIDING) or {})}})
        return full, local
    full = parse_rope({**cfg, "rope_theta": cfg.get("rope_theta") or 1_000_000.0})
    local = RopeConfig(theta=float(cfg.get("rope_local_base_freq") or 10_000.0))
    return full, local


def gemma_spec_fields(cfg: dict[str, Any], arch: str, name: str) -> dict[str, Any]:
    """Every ``ModelSpec`` field of a Gemma config, with transformers' Gemma defaults (tied head,
    no biases); unsupported options are refused by name."""
    version = GEMMA_VERSIONS[arch]
    defaults = family_defaults(arch)
    # transformers' Gemma reads hidden_act, where the legacy "gelu" of the official releases means
    # the tanh approximation (transformers#29402); Gemma 2 and 3 read hidden_activation, as written
    act_key = "hidden_act" if version == 1 else "hidden_activation"
    activation = cfg.get(act_key) or "gelu_pytorch_tanh"
    if version == 1 and activation == "gelu":
        activation = "gelu_pytorch_tanh"
    if activation not in GELU_APPROXIMATIONS:
        raise UnsupportedModelError(f"{arch}: unsupported {act_key} {activation!r}")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"{arch}: bidirectional attention (an embedding model) is not supported")
    hidden = int(cfg["hidden_size"])
    window = None
    if version >= 2:
        window = cfg.get("sliding_window", DEFAULT_SLIDING_WINDOW)  # left out: transformers' default
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise UnsupportedModelError(f"{arch}: sliding_window must be a positive integer or null, got {window!r}")
    rope, rope_local = _gemma3_ropes(cfg) if version == 3 else (parse_rope(cfg), None)
    gemma = GemmaSpec(
        version=version,
        gelu_approximate=GELU_APPROXIMATIONS[activation],
        sliding_window=window,
        # also without a window: Gemma 3 picks each layer's rope by its type
        layer_types=_layer_types(cfg, version, int(cfg["num_hidden_layers"]), arch) if version >= 2 else (),
        attn_logit_softcap=_positive(cfg, "attn_logit_softcapping", arch, SOFTCAP_DEFAULTS[version][0]),
        final_logit_softcap=_positive(cfg, "final_logit_softcapping", arch, SOFTCAP_DEFAULTS[version][1]),
        rope_local=rope_local,
    )
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise UnsupportedModelError(f"{arch}: attention_bias / mlp_bias are not part of Gemma")
    return dict(
        **common_spec_fields(cfg, arch, name),
        # transformers' Gemma default, whatever hidden / heads (an explicit null too)
        head_dim=int(cfg.get("head_dim") or defaults.head_dim),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or defaults.max_position_embeddings),
        rope=rope,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qk_norm=version == 3,
        gemma=gemma,
        embedding_multiplier=hidden**0.5,  # rounded to the model dtype where it is applied
        # Gemma 1: head_dim ** -0.5 (None); Gemma 2 and 3: query_pre_attn_scalar ** -0.5
        attention_multiplier=(_positive(cfg, "query_pre_attn_scalar", arch) or 256.0) ** -0.5 if version >= 2 else None,
    )
