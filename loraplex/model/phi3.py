"""The Phi-3 family (``Phi3ForCausalLM``: Phi-3-mini-4k/128k, Phi-3-medium, Phi-3.5-mini,
Phi-4-mini) on loraplex's Llama-family decoder.

The decoder is Llama's (pre-norm RMSNorm blocks, SwiGLU with gate before up, no biases); what
Phi-3 does differently is settled here, as transformers 5's ``Phi3ForCausalLM`` does it:

* Checkpoints store the packed projections fused (``self_attn.qkv_proj``, ``mlp.gate_up_proj``,
  q/k/v and gate/up along the output rows, the same packing as loraplex's), and PEFT adapters
  trained on Phi-3 target those fused modules. ``phi3_lora_target_spec`` makes each fused module
  one slice of its packed projection, so a fused adapter's A ``[r, hidden]`` and B
  ``[q + k + v, r]`` go into the slot as they are (one shrink, one expand).
* Rope: ``default`` or LongRoPE (``PHI3_ROPE_TYPES``; transformers refuses other types for
  Phi-3); ``su`` and ``yarn`` in older configs are LongRoPE (``Phi3Config`` renames them). The
  original context is the config's top-level ``original_max_position_embeddings`` (Phi3Config's
  default 4096 when absent), which transformers puts before the rope dict's own. Partial rotary
  (``partial_rotary_factor``, Phi-4-mini's 0.75) rotates the first ``head_dim * factor`` dims.
* ``sliding_window``: transformers' Phi-3 masks attention to the window whenever the config sets
  one (Phi-3-mini-4k: 2047 of 4096 positions); so does loraplex, on every layer, as for a
  Mistral (the context is not capped). A window at least as long as the positions (the 128k
  models' 262144) changes nothing.
"""

from __future__ import annotations

from typing import Any

from loraplex.lora.spec import LoRATargetSpec

PHI3_ARCHITECTURE = "Phi3ForCausalLM"
PHI3_ROPE_TYPES = ("default", "longrope")  # the only rope types transformers' Phi3Config accepts
PHI3_DEFAULT_ORIGINAL_CONTEXT = 4096  # transformers' Phi3Config.original_max_position_embeddings
# the HF module names of Phi-3's LoRA-targetable linears, in the order the decoder runs them
PHI3_LORA_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def phi3_config_view(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` (a Phi-3 ``config.json``) as transformers' ``Phi3Config`` reads it: the rope type
    renamed to ``longrope`` where it was ``su`` or ``yarn``, and the original context set."""
    out = dict(cfg)
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    rope = dict(cfg.get(key) or {})
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type in ("su", "yarn"):
        rope_type = "longrope"
    if rope:
        rope.pop("type", None)
        out[key] = {**rope, "rope_type": rope_type}
    out["original_max_position_embeddings"] = (
        cfg.get("original_max_position_embeddings") or PHI3_DEFAULT_ORIGINAL_CONTEXT
    )
    return out


def phi3_lora_target_spec(spec) -> LoRATargetSpec:
    """Phi-3's LoRA targets: the four fused HF modules, each the single slice of its packed
    projection (``spec`` is the model's ``ModelSpec``)."""
    h, i = spec.hidden_size, spec.intermediate_size
    return LoRATargetSpec(
        model_name=spec.name,
        num_layers=spec.num_layers,
        module_shapes={
            "qkv_proj": (h, spec.q_size + 2 * spec.kv_size),
            "o_proj": (spec.q_size, h),
            "gate_up_proj": (h, 2 * i),
            "down_proj": (i, h),
        },
        packed_modules={name: (name,) for name in PHI3_LORA_MODULES},
        vocab_size=spec.vocab_size,
        hidden_size=h,
        tied_embeddings=spec.tie_word_embeddings,
    )
