"""PEFT LoRA adapters: parse, validate against the base model, and name by content.

Entry points:

* ``load_adapter_files(path)`` / ``parse_adapter_bytes(config, weights)`` -> ``ParsedAdapter``:
  format checks that need no base model (no pickle files, config fields, safetensors header,
  NaN/Inf) and the content hash.
* ``validate_adapter(parsed, spec, max_lora_rank)`` -> ``AdapterInfo``: fit to the base model
  (targets, layers, shapes, ranks) and the per-module rank and scaling, with PEFT's own matching
  rules for ``target_modules``, ``layers_to_transform``, ``rank_pattern`` and ``alpha_pattern``.
* ``inspect_adapter_dir(path, spec, max_lora_rank)``: both, for the upload path.
* ``compute_content_hash(path)``.

LoRA tensors on base-model parts that are not run (``LoRATargetSpec.unserved_module_prefixes``:
a multimodal Gemma 3's vision tower, where ``target_modules="all-linear"`` puts some) are
checked for their names only, left out of ``AdapterInfo.modules`` and reported in
``AdapterInfo.warnings``; an adapter with nothing else is refused.

LoRA on the vocabulary modules (``embed_tokens``, ``lm_head``; ``vocab_names`` has PEFT's names)
is validated like the layers' (shapes against the base vocabulary and hidden size, so an
adapter trained on a resized vocabulary is refused naming both sizes) and kept apart in
``AdapterInfo.vocab_modules``; the base-weight copies PEFT saves next to them are checked for
shape and not kept.

LoRA on an MoE model's experts (per-expert modules, or PEFT's ``target_parameters`` on fused
experts; ``expert_format`` has both layouts) is validated where the engine serves it
(``LoRATargetSpec.experts.enabled``) and kept apart in ``AdapterInfo.expert_modules``.

Every failure raises ``InvalidAdapterError`` with a message naming the problem. Pickle files are
never opened. Tensors are built by ``safetensors_io`` from a header we parse and check ourselves.

``fan_in_fan_out``: PEFT stores ``lora_A``/``lora_B`` as ``nn.Linear`` weights (``[r, in]`` and
``[out, r]``) whatever this flag says, and resets it to False on the ``nn.Linear`` projections of
a Llama-family model, so it never changes the math here; it is accepted and part of the hash.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraplex.lora.adapter_config import LoRAConfigView, parse_config
from loraplex.lora.errors import InvalidAdapterError
from loraplex.lora.expert_format import (
    ExpertModuleLoRA,
    ExpertTensorKey,
    check_target_parameters_served,
    expert_label,
    expert_module_keys,
    expert_target_modules,
    expert_targets,
    expert_tensor,
    validate_expert_modules,
)
from loraplex.lora.kv_effect import changes_kv
from loraplex.lora.module_match import (
    TENSOR_PREFIX,
    Matcher,
    add_tied_lm_head,
    enumerate_target_keys,
    parse_tensor_name,
    unserved_module_key,
)
from loraplex.lora.safetensors_io import MAX_HEADER_BYTES, SafetensorsFile, parse_safetensors
from loraplex.lora.spec import TARGET_MODULES, VOCAB_TARGETS, LoRATargetSpec
from loraplex.lora.vocab_checks import base_copies_warning, base_copy_key, check_tied_vocab_loras, check_vocab_shapes
from loraplex.lora.vocab_names import EMBED, LM_HEAD, lm_head_key, prefix_for_lm_head

__all__ = [
    "AdapterInfo",
    "InvalidAdapterError",
    "ModuleLoRA",
    "ParsedAdapter",
    "compute_content_hash",
    "inspect_adapter_dir",
    "load_adapter_files",
    "parse_adapter_bytes",
    "validate_adapter",
]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
# vLLM's former format for an adapter's added tokens (their embed_tokens / lm_head rows, read
# with --lora-extra-vocab-size until vllm-project/vllm#28382 removed it)
NEW_EMBEDDINGS_NAME = "new_embeddings.safetensors"
MAX_CONFIG_BYTES = 1024 * 1024
HASH_VERSION = b"loraplex-adapter-v1\n"
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
# the most any entry of a module's update (scaling x B @ A) may reach: trained updates are orders
# of magnitude below it, and one past float16's range overflows a half-precision forward, whose
# inf/NaN then fills the request's KV blocks (the next owner of such a block read it: see
# kernels/attention_cpu.py) and its logits
MAX_UPDATE_ENTRY = float(torch.finfo(torch.float16).max)


@dataclass
class ParsedAdapter:
    """An adapter that passed the format checks: its config, its tensors (CPU, as stored) and
    its identity. Not yet checked against a base model."""

    config: LoRAConfigView
    tensors: dict[str, torch.Tensor]  # name as stored -> tensor
    tensor_dtypes: dict[str, str]  # name -> safetensors dtype tag
    content_hash: str
    size_bytes: int  # bytes of tensor data


@dataclass(frozen=True)
class ModuleLoRA:
    """One targeted module: layer (-1 for embed_tokens and lm_head), PEFT module name, its
    rank, alpha and scaling, and the names of its two tensors in ``ParsedAdapter.tensors``."""

    layer: int
    module: str  # e.g. "q_proj"
    rank: int
    alpha: float
    scaling: float
    a_name: str  # lora_A.weight: [rank, in_features] (embed_tokens: lora_embedding_A [rank, vocab])
    b_name: str  # lora_B.weight: [out_features, rank] (embed_tokens: lora_embedding_B [hidden, rank])


@dataclass(frozen=True)
class AdapterInfo:
    """What the registry and the engine need to know about a validated adapter."""

    content_hash: str
    rank: int  # max rank over modules
    alpha: float  # lora_alpha of the config (per-module values in ``modules``)
    use_rslora: bool
    targets: tuple[str, ...]  # PEFT module names targeted, TARGET_MODULES then VOCAB_TARGETS order
    layers: tuple[int, ...]  # layers with at least one targeted module
    size_bytes: int
    modules: dict[tuple[int, str], ModuleLoRA]  # (layer, module) -> per-module rank/scaling
    # what the uploader should know, e.g. LoRA on a vision tower this deployment never runs
    warnings: tuple[str, ...] = ()
    vocab_modules: dict[str, ModuleLoRA] = field(default_factory=dict)  # "embed_tokens" / "lm_head"
    # LoRA on an MoE model's experts: (layer, part, expert) -> it (``expert_format``)
    expert_modules: dict[tuple[int, str, int], ExpertModuleLoRA] = field(default_factory=dict)
    # whether the LoRA can change some layer's K/V (``kv_effect``); False: the adapter's requests
    # share the base model's prefix-cache blocks. True unless validation showed otherwise
    changes_kv: bool = True

    def module_ranks(self) -> dict[str, int]:
        ranks = {f"{layer}.{mod}": m.rank for (layer, mod), m in self.modules.items()}
        experts = {expert_label(key): m.rank for key, m in self.expert_modules.items()}
        return ranks | experts | {mod: m.rank for mod, m in self.vocab_modules.items()}

    def module_scalings(self) -> dict[str, float]:
        scalings = {f"{layer}.{mod}": m.scaling for (layer, mod), m in self.modules.items()}
        experts = {expert_label(key): m.scaling for key, m in self.expert_modules.items()}
        return scalings | experts | {mod: m.scaling for mod, m in self.vocab_modules.items()}

    def summary(self) -> dict:
        """JSON-friendly fields for the registry row and the admin API."""
        return {
            "sha256": self.content_hash,
            "rank": self.rank,
            "alpha": self.alpha,
            "use_rslora": self.use_rslora,
            "targets": list(self.targets),
            "layers": list(self.layers),
            "bytes": self.size_bytes,
            "warnings": list(self.warnings),
        }


# ---------------------------------------------------------------------------------------------
# format


def load_adapter_files(path: str | Path, weights_path: str | Path | None = None) -> ParsedAdapter:
    """Parse a PEFT directory, or (``path`` = config file, ``weights_path``) the two files."""
    path = Path(path)
    if weights_path is None:
        if not path.is_dir():
            raise InvalidAdapterError(f"adapter path {str(path)!r} is not a directory")
        reject_pickles(path)
        if (path / NEW_EMBEDDINGS_NAME).exists():
            # served without them, the added tokens would have no embedding and no logit
            raise InvalidAdapterError(
                f"{NEW_EMBEDDINGS_NAME} holds embeddings of tokens the adapter adds to the vocabulary: adapters "
                "with added tokens are not served (vLLM dropped them too); train without new tokens")
        config_file, weights_file = path / CONFIG_NAME, path / WEIGHTS_NAME
    else:
        config_file, weights_file = path, Path(weights_path)
        for f in (config_file, weights_file):
            if f.suffix.lower() in PICKLE_SUFFIXES:
                raise InvalidAdapterError(f"pickle file {f.name!r} refused: only safetensors weights are loaded")
    if not config_file.is_file():
        raise InvalidAdapterError(f"{CONFIG_NAME} is missing")
    if not weights_file.is_file():
        raise InvalidAdapterError(f"{WEIGHTS_NAME} is missing")
    if config_file.stat().st_size > MAX_CONFIG_BYTES:
        raise InvalidAdapterError(f"{CONFIG_NAME} is larger than {MAX_CONFIG_BYTES} bytes")
    return parse_adapter_bytes(config_file.read_bytes(), weights_file.read_bytes())


def reject_pickles(directory: Path) -> None:
    for f in sorted(directory.rglob("*")):
        if f.suffix.lower() in PICKLE_SUFFIXES:
            raise InvalidAdapterError(
                f"pickle file {str(f.relative_to(directory))!r} found in the adapter directory: "
                "refused (pickles can run code); save the adapter with safetensors"
            )


def parse_adapter_bytes(
    config_bytes: bytes, weights_bytes: bytes, max_header_bytes: int = MAX_HEADER_BYTES
) -> ParsedAdapter:
    """Format checks on the two files' contents; see the module docstring."""
    config = parse_config(config_bytes)
    st = parse_safetensors(weights_bytes, max_header_bytes=max_header_bytes)
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(st.entries):
        t = st.tensor(name)
        if t.numel() and not bool(torch.isfinite(t).all()):
            raise InvalidAdapterError(f"tensor {name!r} contains NaN or Inf")
        tensors[name] = t
    return ParsedAdapter(
        config=config,
        tensors=tensors,
        tensor_dtypes={n: e.dtype for n, e in st.entries.items()},
        content_hash=_content_hash(config, st),
        size_bytes=sum(e.end - e.begin for e in st.entries.values()),
    )


def _content_hash(config: LoRAConfigView, st: SafetensorsFile) -> str:
    """sha256 over canonical JSON of the math-changing config fields, then every tensor in
    sorted name order: name, dtype, shape, raw bytes (each length-prefixed, so unambiguous)."""
    h = hashlib.sha256(HASH_VERSION)
    canon = json.dumps(config.canonical(), sort_keys=True, separators=(",", ":")).encode()
    _put(h, canon)
    for name in sorted(st.entries):
        e = st.entries[name]
        _put(h, name.encode())
        _put(h, e.dtype.encode())
        _put(h, json.dumps(list(e.shape)).encode())
        _put(h, st.raw_bytes(name))
    return h.hexdigest()


def _put(h, data: bytes | memoryview) -> None:
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)


def compute_content_hash(path: str | Path) -> str:
    """The content hash (adapter identity) of a PEFT directory. Raises ``InvalidAdapterError``."""
    return load_adapter_files(path).content_hash


# ---------------------------------------------------------------------------------------------
# fit to the base model


def validate_adapter(parsed: ParsedAdapter, spec: LoRATargetSpec, max_lora_rank: int) -> AdapterInfo:
    """Check that ``parsed`` fits the base model described by ``spec``; see module docstring."""
    cfg = parsed.config
    for layer in cfg.layer_indexes():
        if not 0 <= layer < spec.num_layers:
            raise InvalidAdapterError(
                f"layers_to_transform names layer {layer}, but the base model has {spec.num_layers} layers"
            )

    check_target_parameters_served(cfg, spec)

    # Which module keys the tensors belong to (and the key prefix PEFT saw, e.g. "model.").
    by_key: dict[str, dict[str, str]] = {}  # module key -> {"A": name, "B": name}
    expert_tensors: dict[str, dict[str, str]] = {}  # the same for expert modules
    expert_keys: dict[str, ExpertTensorKey] = {}
    unserved: set[str] = set()  # module keys on parts of the base model loraplex does not run
    base_copies: dict[str, str] = {}  # vocabulary module key -> its saved base weight (not used)
    lm_head_keys: set[str] = set()
    prefix: str | None = None
    for name in parsed.tensors:
        unserved_key = unserved_module_key(name, spec)
        if unserved_key is not None:
            unserved.add(unserved_key)
            continue
        copy = base_copy_key(name, parsed.tensors[name], spec)
        if copy is not None:
            base_copies[copy] = name
            continue
        ek, which = expert_tensor(name, spec)
        tn = parse_tensor_name(name, spec) if ek is None else None
        tensor_prefix = ek.prefix if ek is not None else tn.prefix
        if tensor_prefix is None:  # lm_head: no layer prefix in its name
            lm_head_keys.add(tn.module_key)
        elif prefix is None:
            prefix = tensor_prefix
        elif tensor_prefix != prefix:
            raise InvalidAdapterError(f"tensor {name!r} has module prefix {tensor_prefix!r}, others {prefix!r}")
        if ek is not None:
            expert_keys[ek.module_key] = ek
            expert_tensors.setdefault(ek.module_key, {})[which] = name
        else:
            by_key.setdefault(tn.module_key, {})[tn.which] = name
    if not parsed.tensors:
        raise InvalidAdapterError("adapter has no tensors")
    if not by_key and not unserved and not expert_keys:
        raise InvalidAdapterError("adapter has no LoRA tensors (only copies of base-model weights)")
    if prefix is None and lm_head_keys:
        prefix = prefix_for_lm_head(min(lm_head_keys))
    if not by_key and not expert_keys:
        raise InvalidAdapterError(
            f"adapter has LoRA weights only on modules base model {spec.model_name!r} does not run here "
            f"(e.g. {min(unserved)!r}; images are not served): it would change no output"
        )

    served_experts = spec.experts is not None and spec.experts.enabled
    targeted = add_tied_lm_head(cfg, spec, prefix, enumerate_target_keys(
        cfg, spec, prefix, frozenset(unserved), tuple(expert_module_keys(spec, prefix)) if served_experts else (),
        experts_targeted=bool(expert_keys)))
    shapes = {n: tuple(parsed.tensors[n].shape) for names in expert_tensors.values() for n in names.values()}
    expert_modules = validate_expert_modules(
        cfg, spec, prefix, expert_tensors, expert_keys, shapes, Matcher(cfg, expert_target_modules(cfg, spec)).targets,
        max_lora_rank) if served_experts else {}
    for key in by_key:
        if key not in targeted:
            raise InvalidAdapterError(
                f"extra tensors for module {key!r}, which adapter_config.json does not target"
            )
    for key, name in base_copies.items():
        if key not in targeted:  # PEFT saves these only beside a targeted module's LoRA
            raise InvalidAdapterError(
                f"tensor {name!r} holds full weights of {key!r}, which adapter_config.json does not target "
                "(fully trained modules, as modules_to_save, are not served)"
            )

    modules: dict[tuple[int, str], ModuleLoRA] = {}
    vocab_modules: dict[str, ModuleLoRA] = {}
    for key, (layer, mod) in targeted.items():
        names = by_key.get(key, {})
        for which in ("A", "B"):
            if which not in names:
                raise InvalidAdapterError(f"missing tensor lora_{which} for targeted module {key!r}")
        rank, alpha = cfg.rank_alpha_for(key)
        if rank > max_lora_rank:
            raise InvalidAdapterError(
                f"module {key!r} has rank {rank}, above this engine's max_lora_rank {max_lora_rank}",
                param="adapter",
            )
        in_f, out_f = spec.module_shapes[mod] if layer >= 0 else spec.vocab_shapes[mod]
        a, b = parsed.tensors[names["A"]], parsed.tensors[names["B"]]
        if layer < 0:
            check_vocab_shapes(mod, names, a, b, rank, spec)
        if tuple(a.shape) != (rank, in_f):
            raise InvalidAdapterError(
                f"{names['A']!r} has shape {list(a.shape)}, base model needs [{rank}, {in_f}] (rank {rank})"
            )
        if tuple(b.shape) != (out_f, rank):
            raise InvalidAdapterError(
                f"{names['B']!r} has shape {list(b.shape)}, base model needs [{out_f}, {rank}] (rank {rank})"
            )
        scaling = cfg.scaling(rank, alpha)
        if not abs(scaling) <= FLOAT32_MAX:  # slot scalings are float32 on every device
            raise InvalidAdapterError(
                f"module {key!r} has scaling {scaling:g} (lora_alpha {alpha:g}, rank {rank}), beyond float32"
            )
        check_update_bound(key, a, b, scaling)
        module = ModuleLoRA(
            layer=layer,
            module=mod,
            rank=rank,
            alpha=alpha,
            scaling=scaling,
            a_name=names["A"],
            b_name=names["B"],
        )
        if layer < 0:
            vocab_modules[mod] = module
        else:
            modules[(layer, mod)] = module

    if vocab_modules.keys() >= {EMBED, LM_HEAD}:
        check_tied_vocab_loras(cfg, spec, by_key[f"{prefix}embed_tokens"], by_key[lm_head_key(prefix)], parsed.tensors)
    for expert_key, m in expert_modules.items():
        check_update_bound(expert_label(expert_key), parsed.tensors[m.a_name], parsed.tensors[m.b_name], m.scaling)

    present = {mod for (_, mod) in modules}
    warnings = []
    if unserved:
        warnings.append(_unserved_warning(unserved))
    if base_copies:
        warnings.append(base_copies_warning(base_copies))
    return AdapterInfo(
        content_hash=parsed.content_hash,
        rank=max(m.rank for m in (*modules.values(), *vocab_modules.values(), *expert_modules.values())),
        alpha=cfg.lora_alpha,
        use_rslora=cfg.use_rslora,
        targets=(*(m for m in TARGET_MODULES if m in present), *(m for m in VOCAB_TARGETS if m in vocab_modules),
                 *expert_targets(expert_modules)),
        layers=tuple(sorted({layer for (layer, _) in modules} | {layer for (layer, _, _) in expert_modules})),
        size_bytes=parsed.size_bytes,
        modules=dict(sorted(modules.items())),
        warnings=tuple(warnings),
        vocab_modules={m: vocab_modules[m] for m in VOCAB_TARGETS if m in vocab_modules},
        expert_modules=expert_modules,
        changes_kv=changes_kv(modules, vocab_modules, (layer for (layer, _, _) in expert_modules), spec.num_layers),
    )


def check_update_bound(key: str, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
    """Refuse a module whose update ``scaling * B @ A`` could hold an entry past
    ``MAX_UPDATE_ENTRY``. Each entry of B @ A is a dot product of a row of B and a column of A,
    so (Cauchy-Schwarz) at most the largest row norm of B times the largest column norm of A: no
    product to compute. The bound can exceed the true largest entry (by at most the rank's
    square root for random weights), far less than the distance from a trained update to it."""
    bound = abs(scaling) * float(b.double().norm(dim=1).max()) * float(a.double().norm(dim=0).max())
    if not bound <= MAX_UPDATE_ENTRY:
        raise InvalidAdapterError(
            f"module {key!r}: its update (scaling {scaling:g} x lora_B @ lora_A) may reach {bound:.3g} per weight, "
            f"beyond {MAX_UPDATE_ENTRY:g}: an update that large overflows the forward pass (check lora_alpha, "
            "alpha_pattern and the weights)"
        )


def _unserved_warning(unserved: set[str]) -> str:
    return (
        f"ignored the LoRA weights on {len(unserved)} modules outside the language model (e.g. {min(unserved)!r}): "
        "this deployment serves the text model only and refuses images, so those modules never run; "
        "text outputs are exactly what the adapter's language-model modules give"
    )


def inspect_adapter_dir(path: str | Path, spec: LoRATargetSpec, max_lora_rank: int) -> AdapterInfo:
    """Parse and validate a PEFT directory in one call (the upload path)."""
    return validate_adapter(load_adapter_files(path), spec, max_lora_rank)
