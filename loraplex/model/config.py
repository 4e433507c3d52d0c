"""``ModelSpec``: the shape of a Llama-family decoder, parsed from a Hugging Face ``config.json``.

Both config forms are read: the older one (``rope_theta`` plus ``rope_scaling``), which most
published models use, and transformers 5's ``rope_parameters`` dict.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplex.lora.spec import LoRATargetSpec
from loraplex.model.family_defaults import family_defaults
from loraplex.model.fp8_config import Fp8WeightFormat, QuantizationRefused, fp8_weight_format
from loraplex.model.gemma3_multimodal import GEMMA3_MULTIMODAL, UNSERVED_PREFIXES, gemma3_text_config, image_token_id
from loraplex.model.longrope import LongRopeConfigError, parse_longrope
from loraplex.model.moe_config import (
    MIXTRAL, MOE_ARCHITECTURES, MOE_MODEL_TYPES, QWEN2_MOE, QWEN3_MOE, MoESpec, moe_lora_target_spec,
    moe_spec_from_config,
)
from loraplex.model.phi3 import PHI3_ARCHITECTURE, PHI3_ROPE_TYPES, phi3_config_view, phi3_lora_target_spec
from loraplex.model.qwen_windows import QWEN_ARCHITECTURES, qwen_layer_windows

# architecture name in config.json -> whether q/k/v carry a bias by design, whether each
# q and k head is RMS-normed before the rotary embedding (Qwen3's q_norm / k_norm), and whether
# the config's scalar multipliers apply (Granite's; see ``parse_multipliers``)
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False, "multipliers": False},
    # Gemma 1/2/3 text: ModelSpec.from_dict hands their configs to gemma_config.gemma_spec_fields
    "GemmaForCausalLM": {"qkv_bias": False, "qk_norm": False, "multipliers": False},
    "Gemma2ForCausalLM": {"qkv_bias": False, "qk_norm": False, "multipliers": False},
    "Gemma3ForCausalLM": {"qkv_bias": False, "qk_norm": True, "multipliers": False},
    # its text model only (images are refused): see loraplex.model.gemma3_multimodal
    GEMMA3_MULTIMODAL: {"qkv_bias": False, "qk_norm": True, "multipliers": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False, "multipliers": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False, "multipliers": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True, "multipliers": False},
    "GraniteForCausalLM": {"qkv_bias": False, "qk_norm": False, "multipliers": True},
    PHI3_ARCHITECTURE: {"qkv_bias": False, "qk_norm": False, "multipliers": False},  # see loraplex.model.phi3
    **MOE_ARCHITECTURES,  # Mixtral, Qwen2-MoE, Qwen3-MoE: see loraplex.model.moe_config
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
MISTRAL_DEFAULT_SLIDING_WINDOW = 4096  # transformers' MistralConfig, for a config without the key
# a key config.json leaves out takes the family's transformers default: family_defaults.py

if TYPE_CHECKING:
    from loraplex.model.gemma_config import GemmaSpec


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or option loraplex does not implement."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters. ``scaling`` holds the type-specific keys (``factor``, ...)."""

    rope_type: str = "default"
    theta: float = 10000.0
    scaling: dict[str, float] = field(default_factory=dict)
    partial_rotary_factor: float = 1.0  # the first head_dim * factor dims rotate (Phi-4-mini: 0.75)
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors below the original context
    long_factor: tuple[float, ...] = ()  # longrope: ... from the original context on

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)


@dataclass(frozen=True)
class ModelSpec:
    """Everything the decoder, the loader and the KV-cache sizing need to know about a model."""

    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim on every q and k head, before rotary (Qwen3)
    gemma: GemmaSpec | None = None  # Gemma 1/2/3's departures from Llama (gemma_config.py)
    # Granite's scalar multipliers; these defaults leave a Llama unchanged
    embedding_multiplier: float = 1.0  # the token embeddings are multiplied by it
    attention_multiplier: float | None = None  # the softmax scale; None = head_dim ** -0.5
    residual_multiplier: float = 1.0  # each sub-layer's output is multiplied by it before the residual add
    logits_scaling: float = 1.0  # the logits are divided by it
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: str | None = None  # "bfloat16", "float32", ... as saved
    # Mistral's / Phi-3's sliding-window attention span (every layer), when it is shorter than
    # the positions: a query at position p attends to keys at positions > p - sliding_window
    sliding_window: int | None = None
    # Qwen2 / Qwen3 with use_sliding_window: per layer, its window (None: global), when the layers
    # differ (max_window_layers); () = every layer attends within ``sliding_window``
    per_layer_windows: tuple[int | None, ...] = ()
    # a multimodal checkpoint's image placeholder token: it stands for vision features loraplex
    # never computes, so a prompt holding it is refused
    image_token_id: int | None = None
    moe: MoESpec | None = None  # the sparse MLP blocks of a mixture-of-experts model (moe_config.py)
    # an FP8 checkpoint's weight format (fp8_config.py); None: the weights are stored unquantized
    weight_format: Fp8WeightFormat | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def served_context_len(self, wanted: int | None) -> int:
        """The context served for vLLM's ``max_model_len`` ``wanted`` (None: the model's whole
        context); ValueError when the model cannot serve it."""
        limit = self.max_context_len
        if wanted is None:
            return limit
        if not 0 < wanted <= limit:
            why = "its YaRN-scaled context" if self.rope.rope_type == "yarn" else "its max_position_embeddings"
            raise ValueError(f"max_model_len={wanted} must be in [1, {limit}] (the model's context: {why})")
        return wanted

    @property
    def max_context_len(self) -> int:
        """The longest context served: ``max_position_embeddings``, or with YaRN the original
        context times its factor (as vLLM derives it). A sliding window does not bound it: the
        windowed layers attend to the window, as the model does."""
        limit = self.max_position_embeddings
        if self.rope.rope_type == "yarn":
            limit = int(self.rope.scaling["original_max_position_embeddings"] * self.rope.scaling["factor"])
        return limit

    @property
    def uniform_sliding_window(self) -> int | None:
        """The window when every layer attends within the same one (Mistral, Phi-3, a Gemma whose
        layers are all windowed): KV before it is never read again. None when any layer is global."""
        if self.gemma is not None:
            gemma = self.gemma
            if gemma.sliding_window is not None and gemma.layer_types and set(gemma.layer_types) == {"sliding_attention"}:
                return gemma.sliding_window
            return None
        if self.per_layer_windows:
            first = self.per_layer_windows[0]
            return first if all(w == first for w in self.per_layer_windows) else None
        return self.sliding_window

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer, the window it attends within (None: the whole context); what the engine
        groups layers by for the KV pool (engine.kv_layout)."""
        if self.gemma is not None:
            return tuple(self.gemma.layer_window(i) for i in range(self.num_layers))
        return self.per_layer_windows or (self.sliding_window,) * self.num_layers

    @property
    def softmax_scale(self) -> float:
        """What attention multiplies q·k by before the softmax."""
        return self.head_dim**-0.5 if self.attention_multiplier is None else self.attention_multiplier

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        """KV-cache bytes one token occupies across all layers (K and V)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_bytes

    def lora_target_spec(self, expert_lora: bool = False) -> LoRATargetSpec:
        """``(in_features, out_features)`` of each LoRA-targetable linear (same in every layer);
        ``expert_lora``: an MoE model's experts take LoRA too (``EngineConfig.enable_expert_lora``)."""
        if self.architecture == PHI3_ARCHITECTURE:  # fused qkv_proj / gate_up_proj
            return phi3_lora_target_spec(self)
        if self.moe is not None:  # attention everywhere, MLP on the dense layers only
            return moe_lora_target_spec(self, expert_lora)
        h, i = self.hidden_size, self.intermediate_size
        return LoRATargetSpec(
            model_name=self.name,
            num_layers=self.num_layers,
            unserved_module_prefixes=UNSERVED_PREFIXES if self.architecture == GEMMA3_MULTIMODAL else (),
            vocab_size=self.vocab_size,
            hidden_size=h,
            tied_embeddings=self.tie_word_embeddings,
            module_shapes={
                "q_proj": (h, self.q_size),
                "k_proj": (h, self.kv_size),
                "v_proj": (h, self.kv_size),
                "o_proj": (self.q_size, h),
                "gate_proj": (h, i),
                "up_proj": (h, i),
                "down_proj": (i, h),
            },
        )

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], name: str = "model", quantization: str | None = None) -> "ModelSpec":
        """The spec a checkpoint's config.json describes; ``UnsupportedModelError`` names what
        loraplex cannot serve, or a key every family needs (``hidden_size``, ...) that is missing.
        ``quantization``: vLLM's option, "fp8" to quantize an unquantized checkpoint at load
        (``fp8_config``); an FP8 checkpoint is read as fp8 either way."""
        try:
            return cls._from_config(cfg, name, quantization)
        except KeyError as exc:
            raise UnsupportedModelError(f"{name}: config.json has no {exc.args[0]!r}, which the model's shape needs") \
                from exc

    @classmethod
    def _from_config(cls, cfg: dict[str, Any], name: str, quantization: str | None) -> "ModelSpec":
        architectures = cfg.get("architectures") or []
        arch = architectures[0] if architectures else _arch_from_model_type(cfg.get("model_type"))
        try:
            weight_format = fp8_weight_format(cfg, quantization)
        except QuantizationRefused as exc:
            raise UnsupportedModelError(f"{arch}: {exc}") from exc
        spec = cls._from_unquantized_dict(cfg, arch, name)
        if weight_format is None:
            return spec
        return replace(spec, weight_format=weight_format)

    @classmethod
    def _from_unquantized_dict(cls, cfg: dict[str, Any], arch: str, name: str) -> "ModelSpec":
        from loraplex.model.gemma_config import GEMMA_VERSIONS, gemma_spec_fields  # it imports this module

        if arch == GEMMA3_MULTIMODAL:  # the text model inside (text_config); the vision tower is not served
            return cls(**gemma_spec_fields(gemma3_text_config(cfg), arch, name), image_token_id=image_token_id(cfg))
        if arch in GEMMA_VERSIONS:  # Gemma's keys and defaults differ enough to be read on their own
            return cls(**gemma_spec_fields(cfg, arch, name))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported model architecture {arch!r} (model_type={cfg.get('model_type')!r}); "
                f"loraplex supports {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        if arch == PHI3_ARCHITECTURE:
            cfg = phi3_config_view(cfg)
        defaults = family_defaults(arch)
        try:
            rope = parse_rope(cfg, PHI3_ROPE_TYPES if arch == PHI3_ARCHITECTURE else SUPPORTED_ROPE_TYPES,
                              default_theta=defaults.rope_theta)
        except LongRopeConfigError as exc:
            raise UnsupportedModelError(f"{arch}: {exc}") from exc
        if arch != PHI3_ARCHITECTURE and rope.partial_rotary_factor != 1.0:
            raise UnsupportedModelError(f"{arch}: partial_rotary_factor != 1 is served for Phi-3 only")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"unsupported hidden_act {act!r} for {arch}; only silu (SwiGLU)")
        # a key left out takes the family's default; an explicit null means hidden_size // heads
        head_dim = cfg.get("head_dim", defaults.head_dim) or int(cfg["hidden_size"]) // int(
            cfg["num_attention_heads"])
        attention_bias = bool(cfg.get("attention_bias", False))  # Llama: on q, k, v and o
        per_layer_windows: tuple[int | None, ...] = ()
        if arch in QWEN_ARCHITECTURES:  # use_sliding_window + max_window_layers (qwen_windows.py)
            try:
                per_layer_windows = qwen_layer_windows(cfg, arch, int(cfg["num_hidden_layers"]))
            except ValueError as exc:
                raise UnsupportedModelError(str(exc)) from exc
        elif cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or []):
            raise UnsupportedModelError(f"sliding-window attention is not supported ({arch})")
        # Mistral's and Phi-3's apply whenever set (Qwen's: per_layer_windows); a Mistral config
        # that leaves the key out gets MistralConfig's default window, an explicit null none
        window = None
        if arch == "MistralForCausalLM":
            window = cfg.get("sliding_window", MISTRAL_DEFAULT_SLIDING_WINDOW)
        elif arch in (PHI3_ARCHITECTURE, MIXTRAL):  # MixtralConfig's default: none
            window = cfg.get("sliding_window")
        moe = None
        if arch in MOE_ARCHITECTURES:
            try:
                moe = moe_spec_from_config(cfg, arch, int(cfg["num_hidden_layers"]))
            except ValueError as exc:
                raise UnsupportedModelError(str(exc)) from exc
        qkv_bias = SUPPORTED_ARCHITECTURES[arch]["qkv_bias"] or attention_bias
        if arch == QWEN2_MOE:  # Qwen2MoeConfig.qkv_bias, on unless the config turns it off
            qkv_bias = bool(cfg.get("qkv_bias", True))
        max_positions = int(cfg.get("max_position_embeddings") or defaults.max_position_embeddings)
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise UnsupportedModelError(f"{arch}: sliding_window must be a positive integer or null, got {window!r}")
        spec = cls(
            **common_spec_fields(cfg, arch, name),
            head_dim=int(head_dim),
            max_position_embeddings=max_positions,
            rope=rope,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=attention_bias,
            qk_norm=SUPPORTED_ARCHITECTURES[arch]["qk_norm"],
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            **(parse_multipliers(cfg, arch) if SUPPORTED_ARCHITECTURES[arch]["multipliers"] else {}),
            sliding_window=int(window) if window is not None and int(window) < max_positions else None,
            moe=moe,
        )
        # a window no context served reaches masks nothing: those layers are global
        per_layer_windows = tuple(w if w is not None and w < spec.max_context_len else None for w in per_layer_windows)
        if any(w is not None for w in per_layer_windows):
            spec = replace(spec, per_layer_windows=per_layer_windows)
        return spec

    @classmethod
    def from_dir(cls, model_dir: str | Path, name: str | None = None, quantization: str | None = None) -> "ModelSpec":
        model_dir = Path(model_dir)
        cfg = json.loads((model_dir / "config.json").read_text())
        return cls.from_dict(cfg, name=name or model_dir.name, quantization=quantization)


def common_spec_fields(cfg: dict[str, Any], arch: str, name: str) -> dict[str, Any]:
    """The ``ModelSpec`` fields every supported family reads from the same keys with the same
    defaults (Gemma's reader, gemma_config.py, adds its own defaults for the rest)."""
    num_heads = int(cfg["num_attention_heads"])
    eos = cfg.get("eos_token_id")
    defaults = family_defaults(arch)
    return dict(
        name=name,
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads", defaults.num_kv_heads) or num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps") or defaults.rms_norm_eps),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        checkpoint_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
    )


def _arch_from_model_type(model_type: str | None) -> str:
    known = {
        "llama": "LlamaForCausalLM",
        "gemma": "GemmaForCausalLM",
        "gemma2": "Gemma2ForCausalLM",
        "gemma3_text": "Gemma3ForCausalLM",
        "gemma3": GEMMA3_MULTIMODAL,
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "granite": "GraniteForCausalLM",
        "phi3": PHI3_ARCHITECTURE,
        **MOE_MODEL_TYPES,
    }
    return known.get(model_type or "", f"<model_type {model_type!r}>")


def _yarn_scaling(cfg: dict[str, Any], params: dict[str, Any], scaling: dict[str, float]) -> dict[str, float]:
    """YaRN's keys with transformers' defaults filled in: the original context, the factor
    (when absent, the context ratio, as DeepSeek-V3's configs expect) and ``truncate`` (a bool
    in the config, kept as 1.0 / 0.0 with the numbers)."""
    original = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings") \
        or cfg.get("max_position_embeddings", 2048)
    factor = scaling.get("factor") or cfg.get("max_position_embeddings", 2048) / original
    return {"original_max_position_embeddings": original, "factor": factor,
            "truncate": 0.0 if params.get("truncate", True) is False else 1.0}


# Granite config key -> ModelSpec field. A key the config leaves out takes transformers'
# GraniteConfig default, 1.0: for attention_multiplier that is a softmax scale of 1, not
# 1/sqrt(head_dim) (transformers' GraniteAttention sets ``scaling = config.attention_multiplier``).
GRANITE_MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")


def parse_multipliers(cfg: dict[str, Any], arch: str) -> dict[str, float]:
    """Granite's four multipliers as ``ModelSpec`` fields; a value that is not a finite number,
    or a ``logits_scaling`` of 0 (the logits would all be inf or NaN), is refused."""
    out: dict[str, float] = {}
    for key in GRANITE_MULTIPLIERS:
        value = cfg.get(key, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UnsupportedModelError(f"{arch}: {key} must be a finite number, got {value!r}")
        out[key] = float(value)
    if out["logits_scaling"] == 0.0:
        raise UnsupportedModelError(f"{arch}: logits_scaling 0 would divide the logits by zero")
    return out


def parse_rope(cfg: dict[str, Any], rope_types: tuple[str, ...] = SUPPORTED_ROPE_TYPES,
               default_theta: float = 10000.0) -> RopeConfig:
    """Rope settings from either config form; a scaling type not in ``rope_types`` is a clear error.
    ``default_theta``: the family's, for a config that gives no ``rope_theta``."""
    params = cfg.get("rope_parameters")
    if params:
        if "rope_type" not in params and "type" not in params and "rope_theta" not in params:
            raise UnsupportedModelError("per-layer-type rope_parameters are not supported")
        params = dict(params)
    else:
        params = dict(cfg.get("rope_scaling") or {})
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    theta = params.pop("rope_theta", None) or cfg.get("rope_theta") or default_theta
    if rope_type == "mrope":  # an older alias of the default rotary embedding
        rope_type = "default"
    if rope_type not in rope_types:
        raise UnsupportedModelError(f"unsupported rope type {rope_type!r}; loraplex supports {', '.join(rope_types)}")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise UnsupportedModelError(f"partial_rotary_factor must be in (0, 1], got {partial!r}")
    scaling = {k: v for k, v in params.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    scaling.pop("partial_rotary_factor", None)
    short_factor = long_factor = ()
    if rope_type == "longrope":
        head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
        longrope, short_factor, long_factor = parse_longrope(cfg, params, int(int(head_dim) * partial))
        scaling.update(longrope)
    if rope_type == "yarn":
        scaling.update(_yarn_scaling(cfg, params, scaling))
    if rope_type == "linear" and "factor" not in scaling:
        raise UnsupportedModelError("linear rope scaling needs a 'factor'")
    if rope_type == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            if key not in scaling:
                raise UnsupportedModelError(f"llama3 rope scaling needs {key!r}")
        scaling.setdefault(
            "original_max_position_embeddings",
            cfg.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 2048),
        )
    return RopeConfig(
        rope_type=rope_type, theta=float(theta), scaling=scaling, partial_rotary_factor=float(partial),
        short_factor=short_factor, long_factor=long_factor,
    )
