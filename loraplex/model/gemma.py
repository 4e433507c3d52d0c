"""Gemma 1, Gemma 2 and Gemma 3 (text) decoders: the Llama decoder's packed projections, LoRA
and paged attention, with Gemma's own layer (see ``gemma_config`` for what differs).

Written against transformers' ``GemmaForCausalLM``, ``Gemma2ForCausalLM`` and
``Gemma3ForCausalLM``, keeping their roundings: the embedding scale is rounded to the model
dtype before the multiply, RMSNorm multiplies by ``1 + w`` in fp32 and rounds once, and the
final soft-cap is applied in ``compute_logits`` so sampling and logprobs see capped logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.model.config import ModelSpec
from loraplex.model.gemma_config import SLIDING
from loraplex.model.layers import AttentionMetadata
from loraplex.model.llama import DecoderLayer, LlamaForCausalLM, LogitsLoRA, LoRAStepContext, plan_attention
from loraplex.model.rope import RotaryEmbedding


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: ``x / rms(x) * (1 + w)`` all in fp32, rounded to ``x``'s dtype once
    (Llama rounds before the multiply; transformers#29402)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


class GemmaDecoderLayer(DecoderLayer):
    """Llama's layer parameters; Gemma 2 and 3 add the norms around the MLP. Here
    ``post_attention_layernorm`` norms the attention output (Gemma 2/3) or the MLP input (Gemma 1),
    as in the checkpoints."""

    def __init__(self, spec: ModelSpec, dtype, device):
        super().__init__(spec, dtype, device)
        if spec.gemma.sandwich_norms:
            h = spec.hidden_size
            self.pre_feedforward_layernorm = nn.Parameter(torch.empty(h, dtype=dtype, device=device), requires_grad=False)
            self.post_feedforward_layernorm = nn.Parameter(torch.empty(h, dtype=dtype, device=device), requires_grad=False)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 1/2/3 decoder plus (tied) LM head; same interface as ``LlamaForCausalLM``."""

    layer_class = GemmaDecoderLayer

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, max_positions: int):
        super().__init__(spec, dtype, device, max_positions)
        # sqrt(hidden_size) as transformers holds it: a tensor in the model dtype (59.866 -> 59.75 in bf16)
        self.embed_scale = float(torch.tensor(spec.embedding_multiplier, dtype=dtype))
        self.rotary_local = self._local_rotary(max_positions, dtype, device)

    def _local_rotary(self, max_positions: int, dtype, device) -> RotaryEmbedding | None:
        rope = self.spec.gemma.rope_local
        return None if rope is None else RotaryEmbedding(rope, self.spec.head_dim, max_positions, dtype, device)

    def build_rotary(self, max_positions: int, dtype, device) -> None:
        super().build_rotary(max_positions, dtype, device)
        self.rotary_local = self._local_rotary(max_positions, dtype, device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        lora: LoRAStepContext | None = None,
    ) -> torch.Tensor:  # [T, hidden_size]
        spec, gemma = self.spec, self.spec.gemma
        eps = spec.rms_norm_eps
        hidden = F.embedding(input_ids, self.embed_tokens).mul_(self.embed_scale)  # [T, H]
        if lora is not None:  # transformers scales inside the embedding module, and PEFT its LoRA too
            lora.apply_embedding(input_ids, hidden, self.embed_scale)
        rope_global = self.rotary.lookup(positions)  # ([T, 1, head_dim], [T, 1, head_dim])
        rope_local = rope_global if self.rotary_local is None else self.rotary_local.lookup(positions)
        plans = plan_attention(kv_caches, attn)
        for i, layer in enumerate(self.layers):
            local = bool(gemma.layer_types) and gemma.layer_types[i] == SLIDING
            # attention block
            x = gemma_rms_norm(hidden, layer.input_layernorm, eps)  # [T, H]
            qk_norm = (gemma_rms_norm, layer.qk_norm) if spec.qk_norm else None  # Gemma 3
            o = self._attention(i, x, qk_norm, rope_local if local else rope_global, attn, kv_caches, plans,
                                lora, sliding_window=gemma.layer_window(i), softcap=gemma.attn_logit_softcap)
            if gemma.sandwich_norms:
                hidden += gemma_rms_norm(o, layer.post_attention_layernorm, eps)
                x = gemma_rms_norm(hidden, layer.pre_feedforward_layernorm, eps)
            else:
                hidden += o
                x = gemma_rms_norm(hidden, layer.post_attention_layernorm, eps)
            # MLP block (GeGLU)
            gate, up = self._project(i, "gate_up", x, lora).chunk(2, dim=-1)  # [T, intermediate] each
            act = F.gelu(gate, approximate=gemma.gelu_approximate).mul_(up)
            down = self._project(i, "down", act, lora)  # [T, H]
            if gemma.sandwich_norms:
                down = gemma_rms_norm(down, layer.post_feedforward_layernorm, eps)
            hidden += down
        return gemma_rms_norm(hidden, self.norm, eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, lora: LogitsLoRA | None = None) -> torch.Tensor:
        # [N, H] -> [N, vocab] fp32, the lm_head LoRA added before the soft-cap
        logits = super().compute_logits(hidden, lora)
        cap = self.spec.gemma.final_logit_softcap
        if cap is not None:  # Gemma 2: what sampling, logprobs and prompt logprobs all read
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits
