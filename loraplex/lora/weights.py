"""An adapter's weights laid out for loraplex's packed projections (host copy).

Per layer and packed module (``LoRATargetSpec.packed_modules``: in Llama's layout qkv_proj =
q, k, v; gate_up_proj = gate, up; o_proj; down_proj; in Phi-3's each fused module alone): for
each slice, ``A [rank_s, in]``, ``B [out_s, rank_s]`` and its scaling, or nothing when the
adapter does not target that slice in that layer. Apart from the layers, ``vocab`` holds the
LoRA on ``embed_tokens`` (``A [rank, vocab]``, ``B [hidden, rank]``, PEFT's lora_embedding_A/B)
and ``lm_head`` (``A [rank, hidden]``, ``B [vocab, rank]``) when targeted, and ``experts`` the
LoRA on an MoE model's experts (``expert_weights``). This is what the host cache holds and what a
device slot is filled from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loraplex.lora.errors import InvalidAdapterError
from loraplex.lora.expert_weights import ExpertSliceLoRA, build_expert_layers, expert_host_nbytes
from loraplex.lora.peft_format import AdapterInfo, ParsedAdapter
from loraplex.lora.spec import LoRATargetSpec


@dataclass
class SliceLoRA:
    """One PEFT module's LoRA inside a packed projection."""

    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out_s, rank]
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class PackedLoRA:
    """LoRA of one packed projection in one layer: one entry per slice, None = not targeted."""

    slices: tuple[SliceLoRA | None, ...]

    @property
    def rank(self) -> int:
        return max((s.rank for s in self.slices if s is not None), default=0)


@dataclass
class AdapterWeights:
    """A validated adapter as loraplex computes with it (CPU tensors in the engine's dtype)."""

    adapter_id: str  # content sha256
    info: AdapterInfo
    layers: dict[tuple[int, str], PackedLoRA]  # (layer, packed module) -> weights; absent = untouched
    nbytes: int
    vocab: dict[str, SliceLoRA] = field(default_factory=dict)  # "embed_tokens" / "lm_head" -> weights
    # an MoE model's experts: layer -> {"gate" / "up" / "down": every expert's} (``expert_weights``)
    experts: dict[int, dict[str, ExpertSliceLoRA]] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.info.rank

    @classmethod
    def build(
        cls, parsed: ParsedAdapter, info: AdapterInfo, spec: LoRATargetSpec, dtype: torch.dtype
    ) -> "AdapterWeights":
        layers: dict[tuple[int, str], PackedLoRA] = {}
        nbytes = 0
        for layer in range(spec.num_layers):
            for packed, names in spec.packed_modules.items():
                slices: list[SliceLoRA | None] = []
                for mod in names:
                    m = info.modules.get((layer, mod))
                    if m is None:
                        slices.append(None)
                        continue
                    a = _cast(parsed, m.a_name, dtype)  # [rank, in]
                    b = _cast(parsed, m.b_name, dtype)  # [out_s, rank]
                    nbytes += a.numel() * a.element_size() + b.numel() * b.element_size()
                    slices.append(SliceLoRA(a=a, b=b, scaling=float(m.scaling)))
                if any(s is not None for s in slices):
                    layers[(layer, packed)] = PackedLoRA(slices=tuple(slices))
        vocab: dict[str, SliceLoRA] = {}
        for mod, m in info.vocab_modules.items():
            a = _cast(parsed, m.a_name, dtype)  # [rank, in]
            b = _cast(parsed, m.b_name, dtype)  # [out, rank]
            nbytes += a.numel() * a.element_size() + b.numel() * b.element_size()
            vocab[mod] = SliceLoRA(a=a, b=b, scaling=float(m.scaling))
        experts: dict[int, dict[str, ExpertSliceLoRA]] = {}
        if info.expert_modules:
            experts = build_expert_layers(info.expert_modules, lambda name: _cast(parsed, name, dtype), spec.experts)
            nbytes += expert_host_nbytes(info.expert_modules, spec.experts, torch.empty(0, dtype=dtype).element_size())
        return cls(adapter_id=info.content_hash, info=info, layers=layers, nbytes=nbytes, vocab=vocab, experts=experts)


def _cast(parsed: ParsedAdapter, name: str, dtype: torch.dtype) -> torch.Tensor:
    """The tensor in the engine's dtype. Values finite in the file but beyond that dtype's range
    (|x| > 65504 in float16) would turn into Inf: refused, as NaN/Inf in the file are."""
    src = parsed.tensors[name]
    t = src.to(dtype).contiguous()
    # the file's values were checked finite when parsed: only a narrowing cast can overflow
    narrowing = src.dtype != dtype and torch.finfo(src.dtype).max > torch.finfo(dtype).max
    if narrowing and t.numel() and not bool(torch.isfinite(t).all()):
        raise InvalidAdapterError(f"tensor {name!r} has values beyond the range of {dtype} (the engine's dtype)")
    return t
