"""Which base-model modules an adapter touches, decided exactly as PEFT decides it.

PEFT matches ``target_modules`` etc. against the module names of the Hugging Face model it was
trained on, e.g. ``model.layers.3.self_attn.q_proj``. loraplex rebuilds those names for every
layer and target module of a Llama-family decoder (the ``prefix`` before ``layers.`` is read off
the adapter's tensor names), plus ``{prefix}embed_tokens`` and ``lm_head`` when the base model
serves LoRA on them (``vocab_names``), and applies PEFT's ``check_target_module_exists`` rules
to them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from loraplex.lora import config_patterns
from loraplex.lora.adapter_config import LoRAConfigView
from loraplex.lora.errors import InvalidAdapterError
from loraplex.lora.spec import TARGET_MODULES, LoRATargetSpec
from loraplex.lora.vocab_names import EMBED, lm_head_key, vocab_module

PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "qkv_proj": "self_attn",  # Phi-3
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "gate_up_proj": "mlp",  # Phi-3
    "down_proj": "mlp",
    "shared_expert.gate_proj": "mlp",  # Qwen2-MoE
    "shared_expert.up_proj": "mlp",
    "shared_expert.down_proj": "mlp",
}
TENSOR_PREFIX = "base_model.model."
_TENSOR_RE = re.compile(r"^(?P<key>.+)\.lora_(?P<which>[AB])\.weight$")
_EMBEDDING_TENSOR_RE = re.compile(r"^(?P<key>.+)\.lora_embedding_(?P<which>[AB])$")
# mod: one name, or two for a module inside a sub-block (Qwen2-MoE's shared_expert.gate_proj)
_KEY_RE = re.compile(
    r"^(?P<prefix>(?:.*\.)?)layers\.(?P<layer>\d+)\.(?P<parent>[^.]+)\.(?P<mod>[^.]+(?:\.[^.]+)?)$"
)
_LAYER_PATH_RE = re.compile(r"(?:^|\.)layers\.\d+\.(?P<path>.+)$")


@dataclass(frozen=True)
class TensorName:
    prefix: str | None  # e.g. "model."; None for lm_head, which tells no layer prefix
    module_key: str  # e.g. "model.layers.3.self_attn.q_proj"
    layer: int  # -1 for the vocabulary modules (embed_tokens, lm_head)
    module: str  # e.g. "q_proj"
    which: str  # "A" or "B"


def _servable_names(spec: LoRATargetSpec) -> str:
    experts = spec.experts is not None and spec.experts.enabled
    names = [*spec.module_shapes, *spec.vocab_shapes, *(("the experts' gate/up/down",) if experts else ())]
    return ", ".join(names) or "none"


def is_moe_module(key: str, spec: LoRATargetSpec) -> bool:
    """Whether module ``key`` (``model.layers.0.mlp.experts.3.gate_proj``, ``...mlp.gate``) is part
    of an MoE model's sparse blocks: a segment below ``layers.N.`` is in ``spec.moe_module_names``."""
    if not spec.moe_module_names:
        return False
    m = _LAYER_PATH_RE.search(key)
    return m is not None and any(seg in spec.moe_module_names for seg in m.group("path").split("."))


MOE_MODULE = "a mixture-of-experts module (expert, router or shared expert)"
ROUTER_NAMES = ("gate", "router", "shared_expert_gate")


def moe_lora_error(what: str, spec: LoRATargetSpec, router: bool = False) -> InvalidAdapterError:
    """The refusal of LoRA on an MoE model's routers (``router``), or on its experts where this
    engine holds no room for it or in a form it does not know (``what`` says which tensor or
    config entry)."""
    experts = spec.experts
    served = f"base model {spec.model_name!r} takes LoRA on {_servable_names(spec)}"
    if router:
        return InvalidAdapterError(f"{what}: LoRA on the router of a mixture-of-experts model (or the shared "
                                   f"expert's gate) is not served, as vLLM does not serve it ({served})")
    if experts is not None and experts.enabled:
        names = "/".join(experts.part_names.values())
        block = "block_sparse_moe" if experts.style == "mixtral" else "mlp"
        return InvalidAdapterError(
            f"{what}: the MLP of layers {list(experts.layers)} is {experts.num_experts} experts, whose LoRA is "
            f"served as per-expert modules ({block}.experts.{{e}}.{names}) or as PEFT's target_parameters "
            f"(mlp.experts.gate_up_proj, mlp.experts.down_proj) ({served})")
    return InvalidAdapterError(
        f"{what}: LoRA on the experts of a mixture-of-experts model needs an engine started with "
        f"--enable-expert-lora (enable_expert_lora=True), which holds slot room for it; this one was not ({served})"
    )


def lora_module_key(name: str) -> tuple[str, str] | None:
    """``(module key, "A" / "B")`` of a ``lora_A.weight`` / ``lora_B.weight`` tensor name, else None."""
    if not name.startswith(TENSOR_PREFIX):
        return None
    m = _TENSOR_RE.match(name[len(TENSOR_PREFIX):])
    return None if m is None else (m.group("key"), m.group("which"))


def _names_router(key: str) -> bool:
    m = _LAYER_PATH_RE.search(key)
    path = (m.group("path") if m else key).split(".")
    return "experts" not in path and any(seg in ROUTER_NAMES for seg in path)


def parse_tensor_name(name: str, spec: LoRATargetSpec) -> TensorName:
    """Split a PEFT tensor name; refuse anything that is not lora_A/lora_B of a servable module."""
    if not name.startswith(TENSOR_PREFIX):
        raise InvalidAdapterError(f"unexpected tensor {name!r} (PEFT LoRA tensors start with {TENSOR_PREFIX!r})")
    rest = name[len(TENSOR_PREFIX) :]
    m = _TENSOR_RE.match(rest)
    embedding = m is None
    if embedding:
        m = _EMBEDDING_TENSOR_RE.match(rest)
    if not m:
        raise InvalidAdapterError(
            f"unexpected tensor {name!r} (only lora_A.weight / lora_B.weight, and lora_embedding_A / "
            "lora_embedding_B on embed_tokens, are served)"
        )
    key, which = m.group("key"), m.group("which")
    vocab = vocab_module(key)
    if vocab is not None:
        return _vocab_tensor_name(name, key, which, embedding, vocab, spec)
    if embedding:
        raise InvalidAdapterError(f"tensor {name!r}: lora_embedding_A / lora_embedding_B belong to embed_tokens only")
    if is_moe_module(key, spec):
        raise moe_lora_error(f"tensor {name!r} targets {key!r}, {MOE_MODULE}", spec, router=_names_router(key))
    k = _KEY_RE.match(key)
    if not k or k.group("mod") not in PARENT or k.group("parent") != PARENT[k.group("mod")]:
        raise InvalidAdapterError(
            f"tensor {name!r} targets module {key!r}, which the base model does not have as a LoRA target "
            f"(this base model's are {_servable_names(spec)})"
        )
    mod = k.group("mod")
    if mod not in spec.module_shapes:
        raise InvalidAdapterError(
            f"tensor {name!r} targets {mod!r}, which base model {spec.model_name!r} lacks "
            f"(its LoRA targets are {_servable_names(spec)})"
        )
    layer = int(k.group("layer"))
    if layer >= spec.num_layers:
        raise InvalidAdapterError(
            f"tensor {name!r} is for layer {layer}, but the base model has {spec.num_layers} layers"
        )
    if not spec.module_in_layer(mod, layer):  # an MoE model's sparse layer has no dense MLP
        raise moe_lora_error(
            f"tensor {name!r} targets {mod!r} in layer {layer}, whose MLP is a sparse block of experts "
            f"(a dense {mod} is in layers {list(spec.module_layers[mod])} only)", spec,
        )
    return TensorName(prefix=k.group("prefix"), module_key=key, layer=layer, module=mod, which=which)


def _vocab_tensor_name(
    name: str, key: str, which: str, embedding: bool, vocab: tuple[str, str | None], spec: LoRATargetSpec
) -> TensorName:
    mod, prefix = vocab
    if mod not in spec.vocab_shapes:
        raise InvalidAdapterError(
            f"tensor {name!r} targets {mod!r}, which base model {spec.model_name!r} does not serve LoRA on "
            f"(its LoRA targets are {_servable_names(spec)})"
        )
    if embedding != (mod == EMBED):  # PEFT's Embedding keeps lora_embedding_*, its Linear lora_*.weight
        want = "lora_embedding_A / lora_embedding_B" if mod == EMBED else "lora_A.weight / lora_B.weight"
        raise InvalidAdapterError(f"tensor {name!r}: PEFT saves LoRA on {mod} as {want}")
    return TensorName(prefix=prefix, module_key=key, layer=-1, module=mod, which=which)


def unserved_module_key(name: str, spec: LoRATargetSpec) -> str | None:
    """The module key of a LoRA tensor on a part of the base model that loraplex does not run
    (``spec.unserved_module_prefixes``: e.g. ``model.vision_tower.encoder.layers.0.mlp.fc1``), or
    None for any other tensor. Such tensors still have to be lora_A / lora_B weights."""
    if not spec.unserved_module_prefixes or not name.startswith(TENSOR_PREFIX):
        return None
    rest = name[len(TENSOR_PREFIX) :]
    if not rest.startswith(spec.unserved_module_prefixes):
        return None
    m = _TENSOR_RE.match(rest)
    if not m:
        raise InvalidAdapterError(f"unexpected tensor {name!r} (only lora_A.weight / lora_B.weight are served)")
    return m.group("key")


def base_module_keys(spec: LoRATargetSpec, prefix: str) -> dict[str, tuple[int, str]]:
    """Every servable module of the base model: HF module name -> (layer, PEFT module name);
    layer -1 for the vocabulary modules."""
    mods = [m for m in TARGET_MODULES if m in spec.module_shapes]
    keys = {
        f"{prefix}layers.{i}.{PARENT[m]}.{m}": (i, m)
        for i in range(spec.num_layers) for m in mods if spec.module_in_layer(m, i)
    }
    vocab_keys = {f"{prefix}embed_tokens": (-1, "embed_tokens"), lm_head_key(prefix): (-1, "lm_head")}
    keys.update({key: lm for key, lm in vocab_keys.items() if lm[1] in spec.vocab_shapes})
    return keys


def enumerate_target_keys(
    cfg: LoRAConfigView, spec: LoRATargetSpec, prefix: str, unserved_keys: frozenset[str] = frozenset(),
    expert_keys: tuple[str, ...] = (), experts_targeted: bool = False,
) -> dict[str, tuple[int, str]]:
    """The base modules ``cfg`` targets, in layer order. Refuses a ``target_modules`` entry that
    names no module the base model can serve, and a config that targets nothing.
    An entry that names only modules of ``unserved_keys`` (the adapter's tensors on parts of the
    base model that are not run, e.g. ``fc1`` of a vision tower) is let through: PEFT found it,
    and so is one that names served experts (``expert_keys``); ``experts_targeted``: the adapter
    has expert LoRA, so matching no layer module is fine."""
    keys = base_module_keys(spec, prefix)
    target_modules = cfg.target_modules
    if target_modules == "all-linear":  # PEFT expands it to every linear but the output layer
        target_modules = tuple(m for m in TARGET_MODULES if m in spec.module_shapes)
    cfg_view = Matcher(cfg, target_modules)
    if not isinstance(target_modules, str):
        for entry in target_modules:
            names_module = any(
                key == entry or key.endswith(f".{entry}") for key in (*keys, *unserved_keys, *expert_keys))
            # on an MoE model, an unmatched w1 / gate / experts / gate_proj ... can only mean experts or routers
            if not names_module and spec.moe_module_names and (
                entry.rsplit(".", 1)[-1] in (*spec.moe_module_names, "gate_proj", "up_proj", "down_proj")
                or is_moe_module(entry, spec)
            ):
                raise moe_lora_error(f"adapter_config.json: target_modules entry {entry!r} names {MOE_MODULE}", spec,
                                     router=entry.rsplit(".", 1)[-1] in ROUTER_NAMES)
            if not names_module:
                raise InvalidAdapterError(
                    f"adapter_config.json: target_modules entry {entry!r} is not a module the base model has as "
                    f"a LoRA target (its LoRA targets are {_servable_names(spec)})"
                )
    targeted = {key: lm for key, lm in keys.items() if cfg_view.targets(key)}
    if not targeted and not experts_targeted:
        raise InvalidAdapterError("adapter_config.json: target_modules matches no module of the base model")
    return targeted


def add_tied_lm_head(
    cfg: LoRAConfigView, spec: LoRATargetSpec, prefix: str, targeted: dict[str, tuple[int, str]]
) -> dict[str, tuple[int, str]]:
    """PEFT's ``ensure_weight_tying`` on a model whose lm_head shares the embedding's weight:
    with the embedding targeted, PEFT ties a LoRA on lm_head to it (``lora_A`` =
    ``lora_embedding_B.T``, ``lora_B`` = ``lora_embedding_A.T``) and drops lm_head from the saved
    ``target_modules``, yet saves its tensors. lm_head counts as targeted then.

    With lm_head targeted and the embedding not, PEFT (``_add_targets_to_tie``) targets the
    embedding itself when it loads the adapter and ties lm_head's LoRA to it, so the saved
    lm_head LoRA acts on the embedding too: every layer's input and K/V change. PEFT saves such
    an adapter with the embedding in ``target_modules`` and its tensors; a config that says
    otherwise (edited by hand) is refused, as serving lm_head alone would give other tokens."""
    embed_key, head_key = f"{prefix}embed_tokens", lm_head_key(prefix)
    if not (cfg.raw.get("ensure_weight_tying") and spec.tied_embeddings):
        return targeted
    if embed_key in targeted:
        return {**targeted, head_key: (-1, "lm_head")}
    if head_key in targeted:
        raise InvalidAdapterError(
            f"adapter_config.json: ensure_weight_tying is set and base model {spec.model_name!r} ties lm_head to "
            "embed_tokens, so PEFT puts this adapter's lm_head LoRA on embed_tokens too, yet target_modules does not "
            "name embed_tokens (PEFT saves it there, with its tensors): save the adapter again with PEFT, or set "
            "ensure_weight_tying to false for a LoRA on lm_head alone"
        )
    return targeted


class Matcher:
    """PEFT's ``check_target_module_exists`` (peft 0.21), restricted to the servable modules."""

    def __init__(self, cfg: LoRAConfigView, target_modules: str | tuple[str, ...]):
        self.cfg = cfg
        self.target_modules = target_modules

    def targets(self, key: str) -> bool:
        cfg = self.cfg
        ex = cfg.exclude_modules
        if ex:
            if isinstance(ex, str):
                if config_patterns.fullmatch("exclude_modules", ex, key):
                    return False
            elif key in ex or any(key.endswith(f".{e}") for e in ex):
                return False
        tm = self.target_modules
        if isinstance(tm, str):
            return config_patterns.fullmatch("target_modules", tm, key)
        if key in tm:
            return True
        found = any(key.endswith(f".{t}") for t in tm)
        if cfg.layers_to_transform is None or not found:
            return found
        # PEFT reads the layer index off the first numbered segment of the key.
        match = None
        if not cfg.layers_pattern:
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
        else:
            for pattern in cfg.layers_pattern:
                match = config_patterns.match("layers_pattern", rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", pattern, key)
                if match is not None:
                    break
        if match is None:
            return False
        return int(match.group("idx")) in cfg.layers_to_transform
