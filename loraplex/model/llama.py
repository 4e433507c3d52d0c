"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Granite, SmolLM2) over a flat batch of tokens.

Tokens of many sequences are concatenated without padding; prefill chunks and decodes share one
forward. K/V go to the paged cache and attention reads it back, both only through
``loraplex.kernels.dispatch``. Projections are packed: ``qkv_proj`` (q, k, v along out) and
``gate_up_proj`` (gate, up), so a step runs four matmuls per layer. An FP8 checkpoint's packed
weights are fp8 with a scale per row beside them (``fp8_weights``); ``linear_weight`` dequantizes
one for its matmul (W8A16), and LoRA acts on the activations as for any base.

Granite's multipliers (``ModelSpec``) are applied where transformers' ``GraniteForCausalLM`` and
vLLM's ``granite.py`` apply them: the embeddings are scaled, the softmax scale is
``attention_multiplier``, each sub-layer's output is scaled before its residual add, and
``compute_logits`` divides by ``logits_scaling``, so sampling and logprobs see Granite's logits.
LoRA on embed_tokens is added to the embedding lookup before the embedding multiplier, and LoRA
on lm_head to the head's logits before ``logits_scaling``, where PEFT's modules sit in transformers.
A multiplier of 1 costs nothing: the multiply is skipped (the spec is fixed, so a captured CUDA
graph holds the same ops every replay).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.kernels import dispatch
from loraplex.model.config import ModelSpec
from loraplex.model.cpu_linear import PrepackedLinear, use_prepacked_linears
from loraplex.model.fp8_weights import dequantize
from loraplex.model.layers import AttentionMetadata, rms_norm
from loraplex.model.rope import RotaryEmbedding, apply_rotary


class LoRAStepContext(Protocol):
    """What the model needs from a step's LoRA context (built by ``loraplex.lora``)."""

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add the LoRA delta of ``module`` in ``layer`` to ``y`` in place (``x`` is the input)."""

    def project(self, layer: int, module: str, x: torch.Tensor, base: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``base()``, the base projection of ``x``, plus the LoRA delta of ``module`` in ``layer``
        (the context may queue part of the LoRA beside ``base``: ``lora.shrink_overlap``)."""

    def apply_embedding(self, input_ids: torch.Tensor, hidden: torch.Tensor, scale: float = 1.0) -> None:
        """Add the embed_tokens LoRA delta (times ``scale``) to the embedding output ``hidden``."""

    def expert_lora(self, layer: int):
        """The step's LoRA on the experts of MoE layer ``layer`` (``kernels.moe_lora.ExpertLoRA``),
        or None when no token of the step has any there."""


class LogitsLoRA(Protocol):
    """The lm_head LoRA of the rows whose logits ``compute_logits`` computes."""

    def apply(self, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """Add each row's lm_head LoRA delta to ``logits`` in place."""


def plan_attention(kv_caches: list[torch.Tensor], attn: AttentionMetadata) -> list:
    """The step's attention work planned once per layer group (each has its own block tables),
    for every layer of the group (``dispatch.plan_paged_attention``)."""
    return [
        dispatch.plan_paged_attention(kv_caches[0], attn.tables_of(g), attn.seq_lens, attn.query_start_loc)
        for g in range(attn.num_groups)
    ]


def _linear_params(out_features: int, in_features: int, bias: bool, dtype, device):
    weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False)
    b = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
    return weight, b


class DecoderLayer(nn.Module):
    """One pre-norm block: attention then SwiGLU MLP, each with a residual."""

    def __init__(self, spec: ModelSpec, dtype, device, mlp_size: int | None = None):
        # mlp_size: the dense SwiGLU's width (None: spec.intermediate_size; 0: no dense MLP, as in
        # a mixture-of-experts layer without a shared expert)
        super().__init__()
        h = spec.hidden_size
        mlp_size = spec.intermediate_size if mlp_size is None else mlp_size
        qkv_out = spec.q_size + 2 * spec.kv_size
        self.input_layernorm = nn.Parameter(torch.empty(h, dtype=dtype, device=device), requires_grad=False)
        self.qkv_weight, self.qkv_bias = _linear_params(qkv_out, h, spec.qkv_bias, dtype, device)
        self.o_weight, self.o_bias = _linear_params(h, spec.q_size, spec.o_bias, dtype, device)
        self.post_attention_layernorm = nn.Parameter(torch.empty(h, dtype=dtype, device=device), requires_grad=False)
        if mlp_size:
            self.gate_up_weight, self.gate_up_bias = _linear_params(2 * mlp_size, h, spec.mlp_bias, dtype, device)
            self.down_weight, self.down_bias = _linear_params(h, mlp_size, spec.mlp_bias, dtype, device)
        if spec.qk_norm:  # [num_heads + num_kv_heads, head_dim]: q_norm's row per q head, k_norm's per k head
            self.qk_norm = nn.Parameter(
                torch.empty(spec.num_heads + spec.num_kv_heads, spec.head_dim, dtype=dtype, device=device),
                requires_grad=False,
            )


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head. ``forward`` returns final hidden states; ``compute_logits``
    projects only the rows that need sampling."""

    layer_class = DecoderLayer  # a family with more per-layer parameters subclasses both

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, max_positions: int):
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Parameter(
            torch.empty(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.layers = nn.ModuleList(self.build_layer(i, dtype, device) for i in range(spec.num_layers))
        self.norm = nn.Parameter(torch.empty(spec.hidden_size, dtype=dtype, device=device), requires_grad=False)
        if spec.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Parameter(
                torch.empty(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device), requires_grad=False
            )
        self.rotary = RotaryEmbedding(spec.rope, spec.head_dim, max_positions, dtype, device)
        self.scale = spec.softmax_scale
        # per layer (k_scale, v_scale) of the KV cache: a checkpoint's calibrated scales when an
        # fp8 cache reads them (``kv_scales``, set by the loader), else 1.0; host floats
        self.kv_scales: list[tuple[float, float]] = [(1.0, 1.0)] * spec.num_layers
        # CPU only: per layer {"qkv", "o", "gate_up", "down"} -> PrepackedLinear (see cpu_linear)
        self.prepacked: list[dict[str, PrepackedLinear]] | None = None
        self.prepacked_head: PrepackedLinear | None = None

    def build_layer(self, index: int, dtype, device) -> nn.Module:
        """Layer ``index``'s parameters (a family whose layers differ overrides it)."""
        return self.layer_class(self.spec, dtype, device)

    def build_rotary(self, max_positions: int, dtype, device) -> None:
        """(Re)build the rotary tables for ``max_positions`` (the loader builds the model on meta first)."""
        self.rotary = RotaryEmbedding(self.spec.rope, self.spec.head_dim, max_positions, dtype, device)

    def prepare_linears(self) -> None:
        """Pack the weights for the CPU matmul path when the policy wants it (call after loading).

        The packed copies are snapshots: call again after changing any weight in place. The
        parameters stay as they are (state_dict, LoRA shapes), so CPU weight memory doubles; an
        FP8 checkpoint's fp8 projections are the exception, released by the loader once packed
        (loader.release_packed_fp8)."""
        weight = self.embed_tokens
        if not use_prepacked_linears(weight.device, weight.dtype):
            self.prepacked = self.prepacked_head = None
            return
        dtype = weight.dtype
        # an fp8 weight is dequantized to fp32 here, once: the prepacked GEMM then runs as for fp32
        self.prepacked = [
            {
                name: PrepackedLinear(self.linear_weight(i, name, torch.float32), getattr(layer, f"{name}_bias"), dtype)
                for name in ("qkv", "o", "gate_up", "down")
                if getattr(layer, f"{name}_weight", None) is not None  # an MoE layer may have no dense MLP
            }
            for i, layer in enumerate(self.layers)
        ]
        self.prepacked_head = PrepackedLinear(self.lm_head_weight, None, torch.float32)

    def linear_weight(self, i: int, name: str, dtype: torch.dtype) -> torch.Tensor:  # [out, in]
        """Layer ``i``'s packed ``name`` weight for a matmul in ``dtype``: the parameter itself, or an
        fp8 one (an FP8 checkpoint's, with its ``{name}_weight_scale``) dequantized (fp8_weights)."""
        layer = self.layers[i]
        weight = getattr(layer, f"{name}_weight")
        scale = getattr(layer, f"{name}_weight_scale", None)
        if scale is None:
            return weight
        block = self.spec.weight_format.block_size
        return dequantize(weight, scale, dtype, block[1] if block else None)

    def _project(self, i: int, name: str, x: torch.Tensor, lora: LoRAStepContext | None,
                 lora_prefix: str = "") -> torch.Tensor:
        """Packed projection ``name`` of layer ``i`` plus its LoRA delta (``{lora_prefix}{name}_proj``:
        Qwen2-MoE's shared expert is the layer's gate_up / down, adapted as ``shared_expert.*``).

        Prepacked CPU path: the delta is added to the fp32 product before rounding to the model
        dtype, and LoRA reads the same fp32 input the GEMM did (one conversion, one rounding)."""
        if self.prepacked is not None:
            linear = self.prepacked[i][name]
            x32 = x.float()
            y = linear.fp32(x32)
            if lora is not None:
                lora.apply(i, f"{lora_prefix}{name}_proj", x32, y)
            return y if y.dtype == linear.out_dtype else y.to(linear.out_dtype)
        def base() -> torch.Tensor:  # [T, out_total]
            return F.linear(x, self.linear_weight(i, name, x.dtype), getattr(self.layers[i], f"{name}_bias"))

        if lora is None:
            return base()
        return lora.project(i, f"{lora_prefix}{name}_proj", x, base)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def _attention(self, i: int, x: torch.Tensor, qk_norm, rope, attn: AttentionMetadata,
                   kv_caches: list[torch.Tensor], plans: list, lora: LoRAStepContext | None,
                   sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """Layer ``i``'s attention block from its normed input ``x`` [T, H] to the o projection's
        output [T, H]: the packed qkv projection, ``qk_norm`` ((norm function, weight) or None)
        on every q and k head, rotary (``rope``: cos, sin), the K/V write and paged attention."""
        spec = self.spec
        num_tokens = x.shape[0]
        k_end = spec.q_size + spec.kv_size
        qkv = self._project(i, "qkv", x, lora)  # [T, q_size + 2 * kv_size]
        # q and k heads rotate in one pass; q and k stay views into the rotated [T, H + kvh, d]
        qk = qkv[:, :k_end].view(num_tokens, spec.num_heads + spec.num_kv_heads, spec.head_dim)
        if qk_norm is not None:
            norm, weight = qk_norm
            qk = norm(qk, weight, spec.rms_norm_eps)
        qk = apply_rotary(qk, *rope)
        q, k = qk[:, : spec.num_heads], qk[:, spec.num_heads :]
        v = qkv[:, k_end:].view(num_tokens, spec.num_kv_heads, spec.head_dim)
        group = attn.group_of(i)  # the layer group whose pages hold this layer's KV
        k_scale, v_scale = self.kv_scales[i]
        dispatch.write_kv_cache(k, v, kv_caches[i], attn.slots_of(group), k_scale, v_scale)
        attn_out = dispatch.paged_attention(
            q,
            kv_caches[i],
            attn.tables_of(group),
            attn.seq_lens,
            attn.query_start_loc,
            self.scale,
            attn.max_query_len,
            attn.max_seq_len,
            plan=plans[group],
            sliding_window=sliding_window,
            softcap=softcap,
            k_scale=k_scale,
            v_scale=v_scale,
        ).reshape(num_tokens, spec.q_size)  # [T, q_size]
        return self._project(i, "o", attn_out, lora)  # [T, H]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        lora: LoRAStepContext | None = None,
    ) -> torch.Tensor:  # [T, hidden_size]
        spec = self.spec
        eps = spec.rms_norm_eps
        hidden = F.embedding(input_ids, self.embed_tokens)  # [T, H]
        if lora is not None:
            lora.apply_embedding(input_ids, hidden)
        if spec.embedding_multiplier != 1.0:
            hidden *= spec.embedding_multiplier  # in the model dtype, as transformers' Granite
        residual_multiplier = spec.residual_multiplier
        cos, sin = self.rotary.lookup(positions)  # [T, 1, head_dim] each
        plans = plan_attention(kv_caches, attn)
        windows = spec.layer_windows  # Mistral's / Phi-3's window on every layer, Qwen's on some
        for i, layer in enumerate(self.layers):
            # attention block
            x = rms_norm(hidden, layer.input_layernorm, eps)  # [T, H]
            qk_norm = (rms_norm, layer.qk_norm) if spec.qk_norm else None
            o = self._attention(i, x, qk_norm, (cos, sin), attn, kv_caches, plans, lora,
                                sliding_window=windows[i])
            if residual_multiplier != 1.0:
                o *= residual_multiplier  # rounded before the add, as in transformers' Granite
            hidden += o  # hidden is this forward's own tensor (the embedding gather's output)
            # MLP block
            x = rms_norm(hidden, layer.post_attention_layernorm, eps)
            down = self._mlp(i, x, lora)  # [T, H]
            if residual_multiplier != 1.0:
                down *= residual_multiplier
            hidden += down
        return rms_norm(hidden, self.norm, eps)

    def _mlp(self, i: int, x: torch.Tensor, lora: LoRAStepContext | None, lora_prefix: str = "") -> torch.Tensor:
        """Layer ``i``'s SwiGLU MLP from its normed input ``x`` [T, H] to [T, H] (a mixture-of-experts
        family overrides it; ``lora_prefix``: see ``_project``)."""
        gate, up = self._project(i, "gate_up", x, lora, lora_prefix).chunk(2, dim=-1)  # [T, intermediate] each
        return self._project(i, "down", F.silu(gate).mul_(up), lora, lora_prefix)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, lora: LogitsLoRA | None = None) -> torch.Tensor:
        # [N, H] -> [N, vocab] fp32; ``lora``: the rows' lm_head LoRA, if any
        if self.prepacked_head is not None:
            logits = self.prepacked_head(hidden)
        else:
            logits = F.linear(hidden, self.lm_head_weight).float()
        if lora is not None:
            lora.apply(hidden, logits)
        if self.spec.logits_scaling != 1.0:
            # divided (not multiplied by the inverse) as transformers does; in fp32, after the head
            logits = logits.div_(self.spec.logits_scaling)
        return logits
