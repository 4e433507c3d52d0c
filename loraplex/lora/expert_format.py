"""LoRA on the experts of a mixture-of-experts model: the two forms adapters come in, checked
against the base model's experts (``LoRATargetSpec.experts``).

* Per-expert modules, as transformers 4 + PEFT saved them and most published MoE adapters hold
  them: ``...layers.{l}.mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` (Qwen MoEs) or
  ``...layers.{l}.block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2`` (Mixtral), each an
  ``nn.Linear`` LoRA (``lora_A [r, in]``, ``lora_B [out, r]``), its rank and alpha from
  ``rank_pattern`` / ``alpha_pattern`` like any module. Every expert or a subset: an expert
  without tensors gets no delta.
* PEFT's ``target_parameters`` on transformers 5's fused experts (``mlp.experts.gate_up_proj``
  ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``), PEFT's ``ParamWrapper`` (peft
  0.21, ``tuners/lora/layer.py``): for a parameter of rank ``r`` (``rank_pattern`` keyed by
  ``...mlp.experts.gate_up_proj``), ``lora_A [r * E, in]`` holds expert ``e``'s A in rows
  ``e*r:(e+1)*r`` and ``lora_B [out, r * E]`` holds expert ``e``'s B in columns ``j*E + e``
  (``reshape(out, r, E)``); expert ``e``'s delta is ``scaling * B_e @ A_e`` with PEFT's
  ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA). Both parameters of one ``experts`` module are
  nested wrappers: in the module's parameter order (``gate_up_proj``, then ``down_proj``) each
  targeted one wraps the ones before it, so the first one's tensors sit under
  ``experts.base_layer.``, the last one's under ``experts.`` (``lora_A.weight`` / ``lora_B.weight``).

PEFT 0.21 matches ``target_parameters`` by name alone: ``layers_to_transform`` and
``exclude_modules`` leave them alone (its saved files hold every sparse layer's), and so does this.

Router LoRA (``gate``, ``mlp.gate.weight`` as a parameter) is refused elsewhere
(``module_match.moe_lora_error``): vLLM does not serve it either.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from loraplex.lora.adapter_config import LoRAConfigView
from loraplex.lora.errors import InvalidAdapterError
from loraplex.lora.module_match import lora_module_key, moe_lora_error
from loraplex.lora.spec import ExpertShapes, LoRATargetSpec

# the expert parts an adapter adapts, as ``AdapterInfo.targets`` lists them (after the vocabulary's)
EXPERT_TARGETS = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")
FUSED_PARAMS = ("gate_up_proj", "down_proj")  # transformers 5's experts, in their parameter order
_PER_EXPERT_RE = re.compile(
    r"^(?P<prefix>(?:.*\.)?)layers\.(?P<layer>\d+)\.(?P<block>mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
    r"(?P<mod>[^.]+)$"
)
_FUSED_RE = re.compile(r"^(?P<prefix>(?:.*\.)?)layers\.(?P<layer>\d+)\.mlp\.experts(?P<depth>(?:\.base_layer)*)$")


@dataclass(frozen=True)
class ExpertTensorKey:
    """The module an expert LoRA tensor belongs to: ``expert`` and ``part`` (``gate`` / ``up`` /
    ``down``) for a per-expert module; ``expert`` None and ``depth`` (its ``base_layer.`` count)
    for PEFT's fused form."""

    prefix: str
    module_key: str
    layer: int
    expert: int | None
    part: str | None
    depth: int = 0


@dataclass(frozen=True)
class ExpertModuleLoRA:
    """One expert LoRA of a validated adapter: per-expert (``expert`` >= 0, ``part`` gate / up /
    down) or fused over all experts (``expert`` -1, ``part`` gate_up / down, ``rank`` per expert)."""

    layer: int
    part: str
    expert: int
    rank: int
    alpha: float
    scaling: float
    a_name: str
    b_name: str


def expert_tensor_key(key: str, spec: LoRATargetSpec) -> ExpertTensorKey | None:
    """``key`` (a module key, ``model.layers.0.mlp.experts.3.gate_proj``) as an expert LoRA
    module of this base model, or None when it is not one."""
    experts = spec.experts
    if experts is None:
        return None
    m = _PER_EXPERT_RE.match(key)
    if m is not None:
        names = {v: k for k, v in experts.part_names.items()}
        block = "block_sparse_moe" if experts.style == "mixtral" else "mlp"
        if m.group("mod") not in names or m.group("block") != block:
            want = ", ".join(f"{block}.experts.{{e}}.{n}" for n in experts.part_names.values())
            raise InvalidAdapterError(f"module {key!r} is not an expert module of base model {spec.model_name!r} "
                                      f"(its experts' modules are {want})")
        layer, expert = int(m.group("layer")), int(m.group("expert"))
        _check_layer(key, layer, experts)
        if expert >= experts.num_experts:
            raise InvalidAdapterError(f"module {key!r} is for expert {expert}, but base model "
                                      f"{spec.model_name!r} has {experts.num_experts} experts per layer")
        return ExpertTensorKey(m.group("prefix"), key, layer, expert, names[m.group("mod")])
    m = _FUSED_RE.match(key)
    if m is not None:
        layer = int(m.group("layer"))
        _check_layer(key, layer, experts)
        return ExpertTensorKey(m.group("prefix"), key, layer, None, None, m.group("depth").count(".base_layer"))
    return None


def expert_tensor(name: str, spec: LoRATargetSpec) -> tuple[ExpertTensorKey | None, str | None]:
    """``(its module, "A" / "B")`` when tensor ``name`` is expert LoRA of this base model, else
    ``(None, None)``; refused (saying how to enable it) where the engine does not serve it."""
    key_which = lora_module_key(name)
    ek = None if key_which is None else expert_tensor_key(key_which[0], spec)
    if ek is None:
        return None, None
    if not spec.experts.enabled:
        raise moe_lora_error(f"tensor {name!r} targets expert module {ek.module_key!r}", spec)
    return ek, key_which[1]


def check_target_parameters_served(cfg: LoRAConfigView, spec: LoRATargetSpec) -> None:
    """Refuse ``target_parameters`` where the engine serves no expert LoRA."""
    if not cfg.target_parameters or (spec.experts is not None and spec.experts.enabled):
        return
    what = f"adapter_config.json: target_parameters {list(cfg.target_parameters)!r} (PEFT's LoRA on raw parameters"
    if spec.experts is None:  # not an MoE model
        raise InvalidAdapterError(f"{what}) names no parameter base model {spec.model_name!r} serves LoRA on")
    raise moe_lora_error(f"{what}, as on fused experts)", spec)


def expert_target_modules(cfg: LoRAConfigView, spec: LoRATargetSpec) -> str | tuple[str, ...]:
    """``target_modules`` as PEFT matches it against per-expert modules: ``all-linear`` takes every
    expert's linears (transformers 4's experts are ``nn.Linear``s)."""
    if cfg.target_modules == "all-linear" and spec.experts is not None:
        return tuple(spec.experts.part_names.values())
    return cfg.target_modules


def expert_label(key: tuple[int, str, int]) -> str:
    """``AdapterInfo.module_ranks``' name of expert module ``(layer, part, expert)``."""
    layer, part, expert = key
    return f"{layer}.experts.{part}" if expert < 0 else f"{layer}.experts.{expert}.{part}"


def expert_targets(modules: dict[tuple[int, str, int], "ExpertModuleLoRA"]) -> tuple[str, ...]:
    """The ``EXPERT_TARGETS`` an adapter's expert modules adapt (fused gate_up: gate and up)."""
    parts = {f"experts.{p}_proj" for (_, part, _) in modules for p in part.split("_")}
    return tuple(t for t in EXPERT_TARGETS if t in parts)


def _check_layer(key: str, layer: int, experts: ExpertShapes) -> None:
    if layer not in experts.layers:
        raise InvalidAdapterError(f"module {key!r} is for layer {layer}, which has no experts "
                                  f"(the sparse layers are {list(experts.layers)})")


def expert_module_keys(spec: LoRATargetSpec, prefix: str) -> list[str]:
    """Every per-expert module key of the base model (what ``target_modules`` entries can name)."""
    experts = spec.experts
    if experts is None:
        return []
    block = "block_sparse_moe" if experts.style == "mixtral" else "mlp"
    return [f"{prefix}layers.{layer}.{block}.experts.{e}.{name}" for layer in experts.layers
            for e in range(experts.num_experts) for name in experts.part_names.values()]


def targeted_fused_params(cfg: LoRAConfigView, spec: LoRATargetSpec, prefix: str) -> dict[int, tuple[str, ...]]:
    """Per sparse layer, the fused expert parameters ``cfg.target_parameters`` names (PEFT's
    match: the key itself or a suffix after a dot), in parameter order. Refuses an entry that
    names none of them (a router's ``gate.weight`` included)."""
    experts = spec.experts
    out: dict[int, tuple[str, ...]] = {}
    if not cfg.target_parameters:
        return out
    keys = {f"{prefix}layers.{layer}.mlp.experts.{p}": (layer, p) for layer in experts.layers for p in FUSED_PARAMS}
    hit: set[str] = set()
    for entry in cfg.target_parameters:
        matched = [k for k in keys if k == entry or k.endswith(f".{entry}")]
        if not matched:
            tail = entry.rsplit(".", 2)[-2:]
            router = tail in (["gate", "weight"], ["router", "weight"]) or "shared_expert_gate" in entry
            what = ("a router's weight: LoRA on routers is not served (vLLM does not serve it either)" if router
                    else f"no parameter base model {spec.model_name!r} serves LoRA on (its experts' "
                         f"mlp.experts.gate_up_proj and mlp.experts.down_proj)")
            raise InvalidAdapterError(f"adapter_config.json: target_parameters entry {entry!r} names {what}")
        hit.update(matched)
    for layer in experts.layers:
        params = tuple(p for p in FUSED_PARAMS if f"{prefix}layers.{layer}.mlp.experts.{p}" in hit)
        if params:
            out[layer] = params
    return out


def validate_expert_modules(
    cfg: LoRAConfigView,
    spec: LoRATargetSpec,
    prefix: str,
    tensors: dict[str, dict[str, str]],  # module key -> {"A": name, "B": name}
    keys: dict[str, ExpertTensorKey],  # module key -> what it is
    shapes: dict[str, tuple[int, ...]],  # tensor name -> shape
    targets_module,  # (key) -> bool: PEFT's target_modules match
    max_lora_rank: int,
) -> dict[tuple[int, str, int], ExpertModuleLoRA]:
    """The adapter's expert LoRA, keyed ``(layer, part, expert)`` (expert -1: fused), checked:
    every tensor's module targeted (target_modules / target_parameters), both A and B present,
    shapes and ranks as the config says, ranks within ``max_lora_rank``."""
    experts = spec.experts
    if experts is None:
        return {}
    fused = targeted_fused_params(cfg, spec, prefix)
    out: dict[tuple[int, str, int], ExpertModuleLoRA] = {}
    seen_fused: set[tuple[int, str]] = set()
    for key, tk in keys.items():
        names = tensors[key]
        for which in ("A", "B"):
            if which not in names:
                raise InvalidAdapterError(f"missing tensor lora_{which} for expert module {key!r}")
        if tk.expert is not None:
            if not targets_module(key):
                raise InvalidAdapterError(
                    f"extra tensors for module {key!r}, which adapter_config.json does not target")
            part, rank_key, num = tk.part, key, 1
            in_f, out_f = experts.part_shape(part)
        else:
            params = fused.get(tk.layer, ())
            index = len(params) - 1 - tk.depth  # the last targeted parameter wraps the others
            if not 0 <= index < len(params):
                raise InvalidAdapterError(
                    f"tensors of {key!r}: adapter_config.json's target_parameters name {list(params) or 'no'} "
                    f"expert parameters in layer {tk.layer}, which PEFT would not nest {tk.depth} deep")
            param = params[index]
            part = "gate_up" if param == "gate_up_proj" else "down"
            rank_key = f"{prefix}layers.{tk.layer}.mlp.experts.{param}"
            seen_fused.add((tk.layer, param))
            num = experts.num_experts
            in_f, out_f = (experts.hidden, 2 * experts.inter) if part == "gate_up" else (experts.inter, experts.hidden)
        rank, alpha = cfg.rank_alpha_for(rank_key)
        if rank > max_lora_rank:
            raise InvalidAdapterError(
                f"module {rank_key!r} has rank {rank}, above this engine's max_lora_rank {max_lora_rank}",
                param="adapter")
        a_shape, b_shape = shapes[names["A"]], shapes[names["B"]]
        if a_shape != (rank * num, in_f):
            raise InvalidAdapterError(f"{names['A']!r} has shape {list(a_shape)}, base model needs "
                                      f"[{rank * num}, {in_f}] (rank {rank}{_per_expert(num)})")
        if b_shape != (out_f, rank * num):
            raise InvalidAdapterError(f"{names['B']!r} has shape {list(b_shape)}, base model needs "
                                      f"[{out_f}, {rank * num}] (rank {rank}{_per_expert(num)})")
        expert = -1 if tk.expert is None else tk.expert
        out[(tk.layer, part, expert)] = ExpertModuleLoRA(
            layer=tk.layer, part=part, expert=expert, rank=rank, alpha=alpha, scaling=cfg.scaling(rank, alpha),
            a_name=names["A"], b_name=names["B"])
    forms = {e == -1 for (_, _, e) in out}
    if len(forms) > 1:  # one layout or the other: both would add two deltas to the same experts
        raise InvalidAdapterError("adapter holds expert LoRA both as per-expert modules and as PEFT's fused "
                                  "target_parameters: one form only")
    for layer, params in fused.items():
        for param in params:
            if (layer, param) not in seen_fused:
                raise InvalidAdapterError(f"missing tensors for targeted parameter "
                                          f"{prefix}layers.{layer}.mlp.experts.{param!s}")
    return dict(sorted(out.items()))


def _per_expert(num: int) -> str:
    return f" per expert, {num} experts" if num > 1 else ""
