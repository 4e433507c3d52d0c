"""Rotary position embeddings (default, linear, llama3, YaRN and LongRoPE scaling; full or
partial rotary), as a cos/sin table indexed by absolute position, so a flat batch of tokens from
many sequences needs one gather. LongRoPE's short/long rule is in ``loraplex.model.longrope``."""

from __future__ import annotations

import math

import torch

from loraplex.model.config import RopeConfig
from loraplex.model.longrope import longrope_angles


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:  # [head_dim // 2] fp32
    """Same arithmetic as transformers' ``ROPE_INIT_FUNCTIONS`` so logits match bit for bit."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.scaling["factor"]
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope.scaling)
    elif rope.rope_type == "yarn":
        inv_freq = _yarn_inverse_frequencies(rope, head_dim)
    return inv_freq


def attention_scaling(rope: RopeConfig) -> float:
    """The factor on cos and sin (YaRN's attention temperature, LongRoPE's attention factor;
    1 for the other types)."""
    if rope.rope_type == "longrope":
        return rope.scaling["attention_factor"]
    if rope.rope_type != "yarn":
        return 1.0
    s = rope.scaling
    if "attention_factor" in s:
        return float(s["attention_factor"])
    if s.get("mscale") and s.get("mscale_all_dim"):
        return _yarn_mscale(s["factor"], s["mscale"]) / _yarn_mscale(s["factor"], s["mscale_all_dim"])
    return _yarn_mscale(s["factor"])


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """YaRN (arXiv:2309.00071): dimensions that rotate fewer than ``beta_slow`` times over the
    original context are interpolated (divided by ``factor``), those rotating more than
    ``beta_fast`` times are kept, a linear ramp between."""
    s = rope.scaling
    factor, original = s["factor"], s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns ``rotations`` times over the context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if s.get("truncate", 1.0):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, head_dim, 2).to(torch.float) / head_dim)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def _llama3_scale(inv_freq: torch.Tensor, s: dict[str, float]) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_context_len = s["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by factor, short ones kept, the band between interpolated
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables ``[max_positions, rotary_dim]`` in the model dtype (computed in fp32);
    ``rotary_dim`` is ``head_dim`` unless the rotary is partial."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, dtype, device):
        rotary_dim = rope.rotary_dim(head_dim)
        if rope.rope_type == "longrope":
            freqs = longrope_angles(rope, rotary_dim, max_positions)  # [max_positions, rotary_dim // 2]
        else:
            inv_freq = inverse_frequencies(rope, rotary_dim)
            positions = torch.arange(max_positions, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq)  # [max_positions, rotary_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, rotary_dim]
        scale = attention_scaling(rope)
        self.max_positions = max_positions
        self.cos = (emb.cos() * scale).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * scale).to(dtype=dtype, device=device)

    def to(self, dtype=None, device=None) -> "RotaryEmbedding":
        self.cos = self.cos.to(dtype=dtype, device=device)
        self.sin = self.sin.to(dtype=dtype, device=device)
        return self

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, shaped ``[num_tokens, 1, rotary_dim]`` to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x[num_tokens, heads, head_dim]`` rotated with the rotate-half convention of HF Llama.

    Both halves of a cos/sin row are equal (the table repeats the frequencies), so each output
    half is two products and one add, written into its half of the result: the same roundings
    as ``x * cos + rotate_half(x) * sin`` without materialising the rotated copy. With partial
    rotary (``cos`` narrower than ``head_dim``) the first ``rotary_dim`` dims rotate and the
    rest pass through, as transformers' Phi-3 does.
    """
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    c, s = cos[..., :half], sin[..., :half]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.mul(x1, c, out=out[..., :half]).sub_(x2 * s)
    torch.mul(x2, c, out=out[..., half:rotary_dim]).add_(x1 * s)
    if rotary_dim < x.shape[-1]:
        out[..., rotary_dim:] = x[..., rotary_dim:]
    return out
