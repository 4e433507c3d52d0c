"""Gemma 3's multimodal checkpoints (``Gemma3ForConditionalGeneration``: gemma-3-4b/12b/27b and
their fine-tunes) served as the Gemma 3 text model inside them.

The config nests the language model's keys under ``text_config`` (``model_type: gemma3_text``)
and the SigLIP vision tower's under ``vision_config``; the top level holds the token ids shared
by both (eos, bos, the image placeholder) and the dtype. The weights store the language model
under a prefix, in one of two namings:

* ``language_model.model.*`` (+ ``language_model.lm_head.weight`` when untied): what the hub
  checkpoints hold, and what transformers' ``save_pretrained`` still writes (5.x maps it to its
  module tree on load, through the ``llava`` rules of ``conversion_mapping.py``);
* ``model.language_model.*`` (+ ``lm_head.weight``): the module tree of transformers >= 4.52,
  which checkpoints saved from a raw ``state_dict`` (merges, other tools) carry.

The vision tower and the multimodal projector are never read: images are not served, so the
text model is all that runs (a text-only request never reaches the vision tower in transformers
either). The image placeholder token (``image_token_index``) stands for vision features that
are never computed here, so prompts holding it are refused (``ModelSpec.image_token_id``).
"""

from __future__ import annotations

from typing import Any

GEMMA3_MULTIMODAL = "Gemma3ForConditionalGeneration"

# checkpoint prefix of the language model -> what loraplex's loader reads the rest under
LANGUAGE_MODEL_PREFIXES = {
    "language_model.model.": "model.",  # the hub's naming
    "language_model.lm_head.": "lm_head.",
    "model.language_model.": "model.",  # transformers >= 4.52 module tree
}
# parts of the multimodal model that are not served, in both namings; also the module names an
# adapter trained on the multimodal model gives them (after PEFT's ``base_model.model.``)
UNSERVED_PREFIXES = ("vision_tower.", "model.vision_tower.", "multi_modal_projector.", "model.multi_modal_projector.")
# top-level keys that apply to the text model and take precedence over text_config's
# (gemma-3-4b-it puts eos_token_id [1, 106] at the top level only)
TOP_LEVEL_IDS = ("bos_token_id", "eos_token_id")
DTYPE_KEYS = ("torch_dtype", "dtype")  # the older name and transformers 5's
# transformers' Gemma3TextConfig defaults for the shape keys (the gemma-2-2b-like shape it was
# written with): the hub's text_config of gemma-3-4b-it leaves out vocab_size, the head counts,
# head_dim and query_pre_attn_scalar and relies on these. Keys not here already default in
# gemma_config.gemma_spec_fields to the same values.
TEXT_CONFIG_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "bos_token_id": 2,
    "eos_token_id": 1,
}


def gemma3_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: ``text_config`` with the top-level keys that concern it."""
    from loraplex.model.config import UnsupportedModelError  # config imports this module

    text = cfg.get("text_config") or {}  # none: transformers builds a default Gemma3TextConfig
    if not isinstance(text, dict):
        raise UnsupportedModelError(f"{GEMMA3_MULTIMODAL}: text_config must be an object, got {type(text).__name__}")
    model_type = text.get("model_type", "gemma3_text")
    if model_type != "gemma3_text":
        raise UnsupportedModelError(f"{GEMMA3_MULTIMODAL}: text_config.model_type {model_type!r} is not gemma3_text")
    merged = {**TEXT_CONFIG_DEFAULTS, **text}
    for key in TOP_LEVEL_IDS:
        if cfg.get(key) is not None:
            merged[key] = cfg[key]
    if any(cfg.get(key) for key in DTYPE_KEYS):  # the checkpoint's dtype is the whole model's
        for key in DTYPE_KEYS:
            merged[key] = cfg.get(key)
    # transformers (5.x) ties the head when the top-level config says so, whatever text_config
    # says; Gemma3Config's default is tied
    merged["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", True))
    return merged


def image_token_id(cfg: dict[str, Any]) -> int | None:
    """The image placeholder id (``image_token_index``; transformers' default 262144)."""
    value = cfg.get("image_token_index", cfg.get("image_token_id", 262_144))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def language_model_key(name: str) -> str | None:
    """A checkpoint tensor name as the text-only loader reads it (``model.layers.0...``,
    ``lm_head.weight``), or None for a tensor of the vision tower or projector, left unread.
    Any other name is returned as is (the loader reports names it does not use)."""
    if name.startswith(UNSERVED_PREFIXES):
        return None
    for prefix, replacement in LANGUAGE_MODEL_PREFIXES.items():
        if name.startswith(prefix):
            return replacement + name[len(prefix) :]
    return name
