"""Merging LoRA adapters into one (LoRAX's per-request ``merged_adapters``), with PEFT's math.

The merge follows PEFT's ``LoraModel.add_weighted_adapter`` for ``combination_type`` in
``linear``, ``ties``, ``dare_linear``, ``dare_ties`` (peft 0.21, ``tuners/lora/model.py`` and
``utils/merge_utils.py``): per targeted module, the ``lora_A`` and ``lora_B`` matrices of the
adapters that target it are merged separately, adapter ``i`` weighted by
``sign(w_i s_i) sqrt(|w_i s_i|)`` on A and ``sqrt(|w_i s_i|)`` on B, where ``s_i`` is its
module's LoRA scaling (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA). The merged adapter has
the common rank ``r`` and ``lora_alpha = r`` (scaling 1), as PEFT's has. A module only some
adapters target merges only theirs (LoRAX and PEFT both take the union of the targets).

Strategies on a stack of task tensors ``T_i`` (one per adapter) with weights ``v_i``:

* ``linear``: ``sum_i v_i T_i``.
* ``ties``: keep each ``T_i``'s ``int(density * numel)`` largest magnitudes, elect a sign per
  element (``total``: of ``sum_i T_i``; ``frequency``: of ``sum_i sign(T_i)``; zero counts as
  positive), then average ``v_i T_i`` over the adapters whose kept element has the elected sign.
* ``dare_linear``: drop each element of ``T_i`` with probability ``1 - density`` and divide the
  rest by ``density``, then ``linear``.
* ``dare_ties``: the same random drop, then ``ties``' sign election and average.

A ``density`` of 1 prunes nothing (PEFT's rule). A single adapter is merged ``linear`` whatever
the strategy asked (PEFT's ``_check_add_weighted_adapter``: one adapter can only be scaled), so
no pruning or drop touches it. DARE's drop is random in PEFT (the global torch
RNG); here each tensor's mask comes from its own generator, seeded from the caller's ``seed``
and the tensor's name, so the same merge (same inputs, same seed) gives the same weights on
any machine and in any order.

Adapters of different ranks are refused (PEFT and LoRAX both refuse them for these strategies),
as are adapters with LoRA on ``embed_tokens`` / ``lm_head`` or on an MoE model's experts (not
merged here; PEFT's add_weighted_adapter refuses ``target_parameters`` too).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.lora.errors import InvalidAdapterError
from loraplex.lora.module_match import TENSOR_PREFIX
from loraplex.lora.peft_format import CONFIG_NAME, WEIGHTS_NAME, AdapterInfo, ParsedAdapter

MERGE_STRATEGIES = ("linear", "ties", "dare_linear", "dare_ties")
MAJORITY_SIGN_METHODS = ("total", "frequency")
USES_DENSITY = ("ties", "dare_linear", "dare_ties")
USES_SIGN_METHOD = ("ties", "dare_ties")
_A_SUFFIX = ".lora_A.weight"


class MergeError(InvalidAdapterError):
    """These adapters cannot be merged as asked (the message says why)."""


@dataclass(frozen=True)
class MergeParams:
    """How to merge: the strategy, one weight per adapter, and the strategy's own knobs (None
    where the strategy has none, so equal merges compare and hash equal)."""

    strategy: str
    weights: tuple[float, ...]
    density: float | None = None  # ties, dare_*: the fraction of each tensor kept
    majority_sign_method: str | None = None  # ties, dare_ties

    def for_count(self, n: int) -> "MergeParams":
        """The parameters PEFT merges ``n`` adapters with: one adapter is always ``linear``."""
        return MergeParams("linear", self.weights) if n == 1 and self.strategy != "linear" else self

    def canonical(self) -> dict:
        return {"strategy": self.strategy, "weights": list(self.weights), "density": self.density,
                "majority_sign_method": self.majority_sign_method}


@dataclass
class MergedAdapter:
    """A merged adapter as PEFT files would hold it."""

    config: dict  # adapter_config.json
    tensors: dict[str, torch.Tensor]  # PEFT tensor name -> float32 tensor


# ---- the strategies on one stack of task tensors ---------------------------------------------


def keep_largest(t: torch.Tensor, density: float) -> torch.Tensor:
    """``t`` with all but its ``int(density * numel)`` largest magnitudes zeroed."""
    if density >= 1.0:
        return t
    k = int(density * t.numel())
    flat = t.reshape(-1)
    keep = torch.zeros_like(flat, dtype=torch.bool)
    if k > 0:
        keep[torch.topk(flat.abs(), k).indices] = True
    return (flat * keep).reshape(t.shape)


def drop_and_rescale(t: torch.Tensor, density: float, generator: torch.Generator) -> torch.Tensor:
    """DARE: each element kept with probability ``density`` (then divided by it), else zero."""
    if density >= 1.0:
        return t
    keep = torch.rand(t.shape, generator=generator, dtype=torch.float32) < density
    return t * keep / density


def elected_sign_mask(stack: torch.Tensor, method: str) -> torch.Tensor:
    """[n, ...] bool: which adapters' elements carry their element's elected sign."""
    signs = stack.sign()
    votes = stack.sum(dim=0) if method == "total" else signs.sum(dim=0)
    elected = torch.where(votes >= 0, 1.0, -1.0)
    return signs == elected


def merge_stack(tensors: list[torch.Tensor], weights: torch.Tensor, params: MergeParams,
                generators: list[torch.Generator]) -> torch.Tensor:
    """One merged tensor from ``tensors`` (same shape, float32), ``weights`` [n] (one each);
    ``generators``: one per tensor, for DARE's drop."""
    density = params.density if params.density is not None else 1.0
    if params.strategy == "ties":
        tensors = [keep_largest(t, density) for t in tensors]
    elif params.strategy in ("dare_linear", "dare_ties"):
        tensors = [drop_and_rescale(t, density, g) for t, g in zip(tensors, generators)]
    stack = torch.stack(tensors)  # [n, *shape]
    weighted = stack * weights.reshape(-1, *([1] * (stack.dim() - 1)))
    if params.strategy in ("linear", "dare_linear"):
        return weighted.sum(dim=0)
    mask = elected_sign_mask(stack, params.majority_sign_method or "total")
    return (weighted * mask).sum(dim=0) / mask.sum(dim=0).clamp(min=1)


# ---- whole adapters --------------------------------------------------------------------------


def tensor_seed(seed: int, name: str) -> int:
    """The DARE generator seed of one output tensor: the merge's seed and the tensor's name."""
    digest = hashlib.sha256(f"{seed}|{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _check_mergeable(parts: list[tuple[ParsedAdapter, AdapterInfo]]) -> int:
    ranks = set()
    for _, info in parts:
        if info.vocab_modules:
            raise MergeError("adapters with LoRA on embed_tokens or lm_head cannot be merged")
        if info.expert_modules:  # PEFT refuses target_parameters too; a merge would silently drop them
            raise MergeError("adapters with LoRA on an MoE model's experts cannot be merged")
        ranks.update(m.rank for m in info.modules.values())
    if len(ranks) != 1:
        raise MergeError(f"adapters of different ranks cannot be merged (ranks {sorted(ranks)}): "
                         "PEFT and LoRAX need one rank for linear, ties and dare merges")
    return ranks.pop()


def merge_adapters(parts: list[tuple[ParsedAdapter, AdapterInfo]], params: MergeParams, seed: int) -> MergedAdapter:
    """Merge validated adapters (the files and their ``validate_adapter`` info, one weight each
    in ``params.weights``) on the CPU in float32; see the module docstring."""
    if len(parts) != len(params.weights):
        raise MergeError(f"{len(parts)} adapters but {len(params.weights)} weights")
    params = params.for_count(len(parts))
    rank = _check_mergeable(parts)
    keys = sorted({key for _, info in parts for key in info.modules})
    tensors: dict[str, torch.Tensor] = {}
    module_keys = []
    for key in keys:
        used = [(parsed, info.modules[key], w) for (parsed, info), w in zip(parts, params.weights) if key in info.modules]
        a_name, b_name = used[0][1].a_name, used[0][1].b_name
        scaled = [w * m.scaling for _, m, w in used]
        weights_a = torch.tensor([math.copysign(math.sqrt(abs(x)), x) for x in scaled], dtype=torch.float32)
        weights_b = torch.tensor([math.sqrt(abs(x)) for x in scaled], dtype=torch.float32)
        for name, which, weights in ((a_name, "a_name", weights_a), (b_name, "b_name", weights_b)):
            stack = [parsed.tensors[getattr(m, which)].to(torch.float32) for parsed, m, _ in used]
            gens = [torch.Generator().manual_seed(tensor_seed(seed, f"{i}|{name}")) for i in range(len(stack))]
            tensors[name] = merge_stack(stack, weights, params, gens).contiguous()
        module_keys.append(a_name[len(TENSOR_PREFIX):-len(_A_SUFFIX)])
    first = parts[0][0].config.raw
    config = {
        "peft_type": "LORA",
        "task_type": first.get("task_type") or "CAUSAL_LM",
        "base_model_name_or_path": first.get("base_model_name_or_path"),
        "r": rank,
        "lora_alpha": rank,  # scaling 1: the weights and scalings are inside A and B (PEFT's choice)
        "use_rslora": False,
        "target_modules": module_keys,  # exact module names: only what some adapter targets
        "bias": "none",
        "fan_in_fan_out": False,
        "lora_dropout": 0.0,
    }
    return MergedAdapter(config=config, tensors=tensors)


def write_adapter_dir(merged: MergedAdapter, path: str | Path) -> Path:
    """Save ``merged`` as a PEFT directory (``adapter_config.json`` + safetensors)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_NAME).write_text(json.dumps(merged.config, indent=2, sort_keys=True))
    save_file(merged.tensors, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
    return path
