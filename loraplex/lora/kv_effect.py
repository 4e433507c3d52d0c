"""Whether an adapter's LoRA can change any layer's K/V, decided once per adapter version when it
is validated (``AdapterInfo.changes_kv``). An adapter that cannot computes exactly the base
model's K/V for every token, so its requests share the base model's prefix-cache blocks (the
block manager keys them as the base's, with the same cache salt) instead of keying them on the
adapter's content hash and recomputing the same K/V.

Why the rule holds (``loraplex/model/``: ``LlamaForCausalLM.forward`` and ``_attention``, and the
Gemma and MoE families, which keep its order): layer ``i`` writes its K/V from the packed qkv
projection of its normed input, which is the residual stream after the embedding and layers
``0 .. i-1``. Nothing read after a K/V write feeds a K/V write of the same or a later position in
that layer, and no layer reads another layer's cache (no cross-layer KV sharing in the served
families). So:

* ``embed_tokens`` LoRA changes the residual stream every layer reads: it changes K/V.
* LoRA on any module of a layer before the last changes the next layer's input: it changes K/V.
* In the last layer, LoRA on the modules after the K/V write (``o_proj``, the MLP's
  ``gate_proj`` / ``up_proj`` / ``gate_up_proj`` / ``down_proj``, Qwen2-MoE's shared expert and
  an MoE layer's experts) changes only that layer's output, i.e. the logits; ``k_proj`` /
  ``v_proj`` / Phi-3's fused ``qkv_proj`` change the K/V written. ``q_proj`` in the last layer
  would not change K/V either, but it shares the packed qkv projection whose output the K/V are
  sliced from, so it is kept on the safe side.
* ``lm_head`` LoRA changes only the logits.

Layer groups and sliding windows change which pages a layer reads, not what it writes, so the
rule is the same for every group. LoRA on parts of the model that never run (a multimodal
checkpoint's vision tower) is not in ``AdapterInfo.modules`` at all.
"""

from __future__ import annotations

from collections.abc import Iterable

# the last layer's modules computed from the attention's output: after its K/V are written
AFTER_KV_WRITE = frozenset({
    "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj",
    "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj",
})


def changes_kv(
    module_keys: Iterable[tuple[int, str]],
    vocab_modules: Iterable[str],
    expert_layers: Iterable[int],
    num_layers: int,
) -> bool:
    """Whether LoRA on ``module_keys`` ((layer, PEFT module name)), on ``vocab_modules``
    (``embed_tokens`` / ``lm_head``) and on the experts of ``expert_layers`` can change the K/V
    of some layer of a ``num_layers``-layer decoder (see module doc)."""
    last = num_layers - 1
    if any(module != "lm_head" for module in vocab_modules):
        return True
    if any(layer != last for layer in expert_layers):
        return True
    return any(layer != last or module not in AFTER_KV_WRITE for layer, module in module_keys)
