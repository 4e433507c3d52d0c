"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE) on loraplex's Llama decoder.

Attention, norms, the paged KV cache and LoRA on the attention projections are the Llama
decoder's; a sparse layer's MLP is a router plus ``num_experts`` SwiGLU experts (``moe_config``
says which layers are sparse and how the router weighs the experts), computed as transformers 5's
``*SparseMoeBlock`` computes it:

1. router logits ``x @ router.T`` [T, E], softmax in fp32, top-k, optionally renormalised;
2. each token's k experts' SwiGLU outputs times the routing weights, summed in fp32 and rounded
   once (transformers 5's default ``grouped_mm`` experts path sums a token's k outputs so):
   ``dispatch.fused_moe``. On CPU that is a torch loop (``kernels/moe_torch.run_experts``: pairs
   sorted by expert, one ``gate_up`` and one ``down`` matmul per expert that got tokens, the
   per-expert counts read on the host). On CUDA it is the fused Triton kernels
   (``kernels/triton_moe``): the pairs grouped into per-expert row blocks on the device, one
   grouped GEMM over ``gate_up`` with SiLU(gate) * up fused, one over ``down`` times the routing
   weight; no host sync and a grid from the token count alone, so decode steps of these models
   are captured as CUDA graphs like a dense model's.

LoRA on the experts (``LoRAStepContext.expert_lora``, where the engine serves it): each pair's
delta for its token's adapter is added to gate_up before SiLU(gate) * up and to down before the
routing weight (``kernels/moe_lora``; on CUDA ``kernels/triton_moe_lora``).

Weights are stacked per layer: ``experts_gate_up [E, 2 * I, H]`` (gate rows then up rows) and
``experts_down [E, H, I]``, transformers 5's in-memory layout. Of an FP8 checkpoint they are fp8
with ``experts_gate_up_scale [E, 2 * I, groups]`` / ``experts_down_scale [E, H, groups]`` fp32
beside them (``moe_weights``), served W8A16: the Triton kernels upcast each fp8 tile to the
compute dtype and apply the scales to the fp32 accumulator; the CPU loop dequantizes the experts
it runs (the loader dequantizes them once at load on CPU unless told to keep them fp8).

Qwen2-MoE's shared expert is held as the layer's dense ``gate_up`` / ``down`` projections of
``shared_expert_intermediate_size``, scaled by ``sigmoid(x @ shared_expert_gate.T)``; its LoRA
(PEFT's ``mlp.shared_expert.gate_proj`` ...) is the packed ``shared_expert.gate_up_proj`` /
``shared_expert.down_proj`` of the slot pool.

Checkpoints: the per-expert layout published models use and ``save_pretrained`` writes
(``block_sparse_moe.experts.{e}.w1/w2/w3`` for Mixtral, ``mlp.experts.{e}.gate_proj/up_proj/
down_proj`` for the Qwen MoEs) and the fused one (``mlp.experts.gate_up_proj`` /
``mlp.experts.down_proj``, ``save_pretrained(save_original_format=False)``) both load.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.kernels import dispatch
from loraplex.kernels.moe_torch import run_experts  # noqa: F401  (the CPU path; tests import it from here)
from loraplex.kernels.moe_torch import ExpertScales
from loraplex.model.config import ModelSpec
from loraplex.model.fp8_config import Fp8WeightFormat
from loraplex.model.fp8_weights import Fp8Weight, pack_fp8, take_fp8_weight, take_full_precision
from loraplex.model.llama import DecoderLayer, LlamaForCausalLM, LoRAStepContext
from loraplex.model.moe_config import MoESpec
from loraplex.model.moe_weights import stacked_shapes, take_experts


class MoEDecoderLayer(DecoderLayer):
    """Llama's attention parameters; a sparse layer adds the router and the stacked experts (and
    Qwen2-MoE's shared expert as the dense MLP), a dense layer keeps Llama's MLP."""

    def __init__(self, spec: ModelSpec, dtype, device, sparse: bool):
        moe = spec.moe
        super().__init__(spec, dtype, device, mlp_size=moe.shared_expert_intermediate_size if sparse else None)
        if not sparse:
            return
        h, e, i = spec.hidden_size, moe.num_experts, moe.expert_intermediate_size

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.router_weight = param(e, h)
        self.experts_gate_up = param(e, 2 * i, h)
        self.experts_down = param(e, h, i)
        if moe.shared_expert_intermediate_size:
            self.shared_expert_gate = param(1, h)


def route_tokens(x: torch.Tensor, router_weight: torch.Tensor, moe: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k], experts [T, k])``: each token's top-k experts and their routing weights,
    as transformers' ``*TopKRouter`` computes them (``x`` [T, H], ``router_weight`` [E, H])."""
    logits = F.linear(x, router_weight)  # [T, E]
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, moe.top_k, dim=-1)  # [T, k] each
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not moe.routing_weights_fp32:
        weights = weights.to(x.dtype)
    return weights, experts


class MoEForCausalLM(LlamaForCausalLM):
    """Mixtral / Qwen2-MoE / Qwen3-MoE decoder plus LM head; the interface of ``LlamaForCausalLM``."""

    def build_layer(self, index: int, dtype, device) -> nn.Module:
        return MoEDecoderLayer(self.spec, dtype, device, sparse=self.spec.moe.sparse_layers[index])

    def expert_scales(self, i: int) -> ExpertScales | None:
        """Sparse layer ``i``'s fp8 expert scales (the loader registers them beside fp8 experts);
        None when its experts are in the compute dtype."""
        layer = self.layers[i]
        gate_up = getattr(layer, "experts_gate_up_scale", None)
        if gate_up is None:
            return None
        block = self.spec.weight_format.block_size
        return ExpertScales(gate_up, layer.experts_down_scale, block[1] if block else None)

    def _mlp(self, i: int, x: torch.Tensor, lora: LoRAStepContext | None) -> torch.Tensor:
        # [T, H] -> [T, H]
        moe = self.spec.moe
        if not moe.sparse_layers[i]:
            return super()._mlp(i, x, lora)
        layer = self.layers[i]
        weights, experts = route_tokens(x, layer.router_weight, moe)
        expert_lora = None if lora is None else lora.expert_lora(i)
        out = dispatch.fused_moe(x, weights, experts, layer.experts_gate_up, layer.experts_down, expert_lora,
                                 self.expert_scales(i))
        if moe.shared_expert_intermediate_size:  # Qwen2-MoE: the dense MLP is the shared expert
            shared = super()._mlp(i, x, lora, lora_prefix="shared_expert.")  # [T, H]
            out = out + torch.sigmoid(F.linear(x, layer.shared_expert_gate)) * shared
        return out


def sparse_layer_params(
    raw: dict[str, torch.Tensor], take: Callable[[str], torch.Tensor], prefix: str, moe: MoESpec,
    fmt: Fp8WeightFormat | None = None,
) -> dict[str, torch.Tensor | Fp8Weight]:
    """The parameters of sparse layer ``prefix`` (``"layers.3."``) from either checkpoint layout
    (module docstring); ``take(name)`` returns a stored tensor and marks it used. Of an FP8
    checkpoint (``fmt``), the experts and the shared expert stored fp8 come back as ``Fp8Weight``
    (``moe_weights``); a router or shared-expert gate stored fp8 is dequantized in fp32."""
    if moe.checkpoint_style == "mixtral" and f"{prefix}block_sparse_moe.gate.weight" in raw:
        block = prefix + "block_sparse_moe."
        parts = ("w1", "w3", "w2")  # gate, up, down
    else:
        block = prefix + "mlp."
        parts = ("gate_proj", "up_proj", "down_proj")
    params = {prefix + "router_weight": take_full_precision(raw, take, block + "gate", fmt)}
    gate_up, down = take_experts(raw, take, block, parts, moe.num_experts, fmt)
    params[prefix + "experts_gate_up"], params[prefix + "experts_down"] = gate_up, down
    e, i = moe.num_experts, moe.expert_intermediate_size
    gate_up, down = stacked_shapes(gate_up, down)
    if (gate_up[0], gate_up[1], down[0], down[2]) != (e, 2 * i, e, i):  # [E, 2I, H], [E, H, I]
        raise ValueError(f"{prefix}experts: the checkpoint's have shapes {list(gate_up)} (gate_up) and "
                         f"{list(down)} (down); the config needs {e} experts of intermediate size {i}")
    if moe.shared_expert_intermediate_size:
        shared = prefix + "mlp.shared_expert."
        for name, modules in (("gate_up_weight", ["gate_proj", "up_proj"]), ("down_weight", ["down_proj"])):
            names = [shared + m for m in modules]
            packed = None if fmt is None else pack_fp8([take_fp8_weight(raw, take, n, fmt) for n in names], names)
            params[prefix + name] = packed if packed is not None else torch.cat([take(n + ".weight") for n in names])
        params[prefix + "shared_expert_gate"] = take_full_precision(raw, take, prefix + "mlp.shared_expert_gate", fmt)
    return params
