"""Mixture-of-experts families: what their ``config.json`` says about the experts, and which
LoRA targets loraplex serves on them.

* ``MixtralForCausalLM`` (Mixtral-8x7B, 8x22B): every layer's MLP is a sparse block of
  ``num_local_experts`` SwiGLU experts (``w1`` gate, ``w3`` up, ``w2`` down) of
  ``intermediate_size``; the router takes the softmax over all experts, keeps the top
  ``num_experts_per_tok`` and renormalises them (transformers keeps those weights in fp32).
* ``Qwen3MoeForCausalLM`` (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (q/k norm); layer ``i``
  is sparse unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``, then
  it has a dense SwiGLU MLP of ``intermediate_size``. Experts are ``moe_intermediate_size``
  wide; ``norm_topk_prob`` says whether the top-k weights are renormalised.
* ``Qwen2MoeForCausalLM`` (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v bias), the
  same sparse layers, plus a shared expert on every sparse layer (a SwiGLU of
  ``shared_expert_intermediate_size``) whose output is scaled by ``sigmoid(shared_expert_gate(x))``.

LoRA: the attention projections of every layer, gate/up/down on the dense MLP layers only
(``LoRATargetSpec.module_layers``), Qwen2-MoE's shared expert (``mlp.shared_expert.gate_proj``
...; not its ``shared_expert_gate``) and, when the engine holds room for it
(``enable_expert_lora``), the experts of the sparse layers (``LoRATargetSpec.experts``; formats
in ``lora/expert_format.py``), as vLLM serves them since v0.11.2 (vllm-project/vllm#21229,
"FusedMoE LoRA"). LoRA on routers or the shared expert's gate is refused with an error that says
so (``LoRATargetSpec.moe_module_names``): vLLM does not serve it either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraplex.lora.spec import PACKED_MODULES, SHARED_EXPERT_PACKED, ExpertShapes, LoRATargetSpec

MIXTRAL = "MixtralForCausalLM"
QWEN2_MOE = "Qwen2MoeForCausalLM"
QWEN3_MOE = "Qwen3MoeForCausalLM"
# architecture -> ModelSpec flags, as config.SUPPORTED_ARCHITECTURES holds them (Qwen2-MoE's
# q/k/v bias is read from its config's ``qkv_bias``, default on)
MOE_ARCHITECTURES: dict[str, dict[str, bool]] = {
    MIXTRAL: {"qkv_bias": False, "qk_norm": False, "multipliers": False},
    QWEN2_MOE: {"qkv_bias": True, "qk_norm": False, "multipliers": False},
    QWEN3_MOE: {"qkv_bias": False, "qk_norm": True, "multipliers": False},
}
MOE_MODEL_TYPES = {"mixtral": MIXTRAL, "qwen2_moe": QWEN2_MOE, "qwen3_moe": QWEN3_MOE}
# module-name segments below ``layers.N.`` that belong to the sparse blocks (experts, routers,
# shared expert): LoRA on them is refused (``module_match.moe_lora_error``) unless it is expert
# LoRA in a form ``lora/expert_format`` reads, on an engine that serves it
MOE_MODULE_NAMES = ("block_sparse_moe", "experts", "gate", "shared_expert", "shared_expert_gate", "w1", "w2", "w3")
# transformers' config defaults for the keys a config may leave out
_DEFAULTS = {
    MIXTRAL: {"num_local_experts": 8, "num_experts_per_tok": 2},
    QWEN2_MOE: {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                "shared_expert_intermediate_size": 5632, "norm_topk_prob": False, "decoder_sparse_step": 1},
    QWEN3_MOE: {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                "norm_topk_prob": False, "decoder_sparse_step": 1},
}


@dataclass(frozen=True)
class MoESpec:
    """The sparse MLP blocks of a mixture-of-experts decoder (see module docstring)."""

    num_experts: int
    top_k: int  # experts per token
    expert_intermediate_size: int
    norm_topk_prob: bool  # renormalise the top-k routing weights to sum to 1
    sparse_layers: tuple[bool, ...]  # per layer: a sparse block (else a dense MLP of intermediate_size)
    # transformers' Mixtral multiplies each expert's output by its fp32 routing weight (then
    # rounds); the Qwen MoEs round the weights to the model dtype first
    routing_weights_fp32: bool = False
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert; 0 = none
    checkpoint_style: str = "qwen"  # per-expert tensor names: "mixtral" (w1/w2/w3) or "qwen"

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i, sparse in enumerate(self.sparse_layers) if not sparse)


def _positive_int(cfg: dict[str, Any], arch: str, key: str, stored_as: str | None = None) -> int:
    """``cfg[key]`` (or ``cfg[stored_as]``), else transformers' default, checked positive."""
    value = cfg.get(key, cfg.get(stored_as or key, _DEFAULTS[arch].get(key)))
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{arch}: {key} must be a positive integer, got {value!r}")
    return value


def moe_spec_from_config(cfg: dict[str, Any], arch: str, num_layers: int) -> MoESpec:
    """The ``MoESpec`` of a Mixtral / Qwen2-MoE / Qwen3-MoE ``config.json``; raises ``ValueError``
    (with the reason) for a config transformers would not build."""
    if arch == MIXTRAL:
        num_experts = _positive_int(cfg, arch, "num_local_experts")
        top_k = _positive_int(cfg, arch, "num_experts_per_tok")
        if top_k > num_experts:
            raise ValueError(f"{arch}: num_experts_per_tok {top_k} exceeds num_local_experts {num_experts}")
        return MoESpec(
            num_experts=num_experts, top_k=top_k, expert_intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=True, sparse_layers=(True,) * num_layers, routing_weights_fp32=True,
            checkpoint_style="mixtral",
        )
    # published configs say num_experts; transformers 5 saves it as num_local_experts
    num_experts = _positive_int(cfg, arch, "num_experts", stored_as="num_local_experts")
    top_k = _positive_int(cfg, arch, "num_experts_per_tok")
    if top_k > num_experts:
        raise ValueError(f"{arch}: num_experts_per_tok {top_k} exceeds num_experts {num_experts}")
    step = _positive_int(cfg, arch, "decoder_sparse_step")
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise ValueError(f"{arch}: mlp_only_layers must be a list of layer indexes, got {dense!r}")
    norm = cfg.get("norm_topk_prob", _DEFAULTS[arch]["norm_topk_prob"])
    if not isinstance(norm, bool):
        raise ValueError(f"{arch}: norm_topk_prob must be a boolean, got {norm!r}")
    shared = _positive_int(cfg, arch, "shared_expert_intermediate_size") if arch == QWEN2_MOE else 0
    return MoESpec(
        num_experts=num_experts, top_k=top_k,
        expert_intermediate_size=_positive_int(cfg, arch, "moe_intermediate_size"),
        norm_topk_prob=norm,
        # transformers' Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer rule
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
        shared_expert_intermediate_size=shared,
    )


def moe_lora_target_spec(spec, expert_lora: bool = False) -> LoRATargetSpec:
    """LoRA targets of an MoE model (``spec``: its ``ModelSpec``): q/k/v/o in every layer,
    gate/up/down in the dense MLP layers only, Qwen2-MoE's shared expert in the sparse ones, the
    experts (``experts``; served when ``expert_lora``); routers are named in ``moe_module_names``
    so that an adapter on them is refused saying why."""
    h, i = spec.hidden_size, spec.intermediate_size
    shapes = {"q_proj": (h, spec.q_size), "k_proj": (h, spec.kv_size), "v_proj": (h, spec.kv_size),
              "o_proj": (spec.q_size, h)}
    module_layers: dict[str, tuple[int, ...]] = {}
    moe = spec.moe
    dense = moe.dense_layers
    if dense:
        shapes.update({"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)})
        module_layers = {m: dense for m in ("gate_proj", "up_proj", "down_proj")}
    packed, moe_names = dict(PACKED_MODULES), MOE_MODULE_NAMES
    si = moe.shared_expert_intermediate_size
    if si:  # Qwen2-MoE's shared expert: a plain SwiGLU in every sparse layer
        sparse = tuple(layer for layer, is_sparse in enumerate(moe.sparse_layers) if is_sparse)
        shared = {"shared_expert.gate_proj": (h, si), "shared_expert.up_proj": (h, si),
                  "shared_expert.down_proj": (si, h)}
        shapes.update(shared)
        module_layers.update({m: sparse for m in shared})
        packed.update(SHARED_EXPERT_PACKED)
        moe_names = tuple(n for n in MOE_MODULE_NAMES if n != "shared_expert")  # its gate stays refused
    return LoRATargetSpec(
        model_name=spec.name,
        num_layers=spec.num_layers,
        module_shapes=shapes,
        packed_modules=packed,
        module_layers=module_layers,
        moe_module_names=moe_names,
        vocab_size=spec.vocab_size,
        hidden_size=h,
        tied_embeddings=spec.tie_word_embeddings,
        experts=ExpertShapes(
            num_experts=moe.num_experts, hidden=h, inter=moe.expert_intermediate_size,
            layers=tuple(layer for layer, is_sparse in enumerate(moe.sparse_layers) if is_sparse),
            style=moe.checkpoint_style, enabled=expert_lora,
        ),
    )
