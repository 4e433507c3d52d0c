"""PEFT's names for LoRA on the two vocabulary modules, ``embed_tokens`` and ``lm_head``.

What PEFT saves (peft 0.21, ``tuners/lora/layer.py`` ``Embedding`` and ``Linear``, and
``utils/save_and_load.py``), after ``base_model.model.``:

* ``{prefix}embed_tokens.lora_embedding_A`` ``[r, vocab]`` and ``...lora_embedding_B``
  ``[hidden, r]``, no ``.weight`` suffix; ``{prefix}`` is the one the layers have (``model.``,
  ``model.language_model.`` or ``language_model.model.`` for Gemma 3 multimodal);
* ``lm_head.lora_A.weight`` ``[r, hidden]`` and ``lm_head.lora_B.weight`` ``[vocab, r]``
  (``language_model.lm_head`` in the older Gemma 3 multimodal module tree);
* with either targeted, ``save_embedding_layers="auto"`` also saves the targeted modules' base
  weights, ``{module}.base_layer.weight`` ``[vocab, hidden]``: frozen copies of the base model's
  own (LoRA trains only A and B). They are shape-checked (a resized vocabulary is refused) and
  never used, as vLLM skips them (``is_base_embeddding_weights`` in vllm/lora/utils.py).
"""

from __future__ import annotations

import re

EMBED = "embed_tokens"
LM_HEAD = "lm_head"
_EMBED_KEY_RE = re.compile(r"^(?P<prefix>(?:.*\.)?)embed_tokens$")
_LM_HEAD_KEYS = ("lm_head", "language_model.lm_head")
_BASE_COPY_RE = re.compile(r"^(?P<key>.+)\.base_layer\.weight$")


def vocab_module(key: str) -> tuple[str, str | None] | None:
    """``(module, layer prefix)`` when ``key`` (a module name after ``base_model.model.``) is
    the embedding (prefix read off it) or the output layer (prefix None: it has none), else None."""
    m = _EMBED_KEY_RE.match(key)
    if m is not None:
        return EMBED, m.group("prefix")
    if key in _LM_HEAD_KEYS:
        return LM_HEAD, None
    return None


def lm_head_key(prefix: str) -> str:
    """The output layer's module name in a model whose layers sit under ``prefix``."""
    return "language_model.lm_head" if prefix.startswith("language_model.") else "lm_head"


def prefix_for_lm_head(key: str) -> str:
    """The layers' prefix of a model whose output layer is named ``key`` (when an adapter has
    tensors on the output layer only, so no other name tells it)."""
    return "language_model.model." if key == "language_model.lm_head" else "model."


def base_copy_module(rest: str) -> tuple[str, str] | None:
    """``(module, module key)`` when ``rest`` (a tensor name after ``base_model.model.``) is the
    base weight PEFT saves next to a targeted vocabulary module, else None."""
    m = _BASE_COPY_RE.match(rest)
    if m is None:
        return None
    found = vocab_module(m.group("key"))
    return None if found is None else (found[0], m.group("key"))
