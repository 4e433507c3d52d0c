"""What the LoRA manager records per adapter, and the small file helpers its loading paths share
(the engine thread's and the background readers')."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from loraplex.config import DEFAULT_MAX_CPU_LORA_BYTES, EngineConfig
from loraplex.lora.errors import AdapterHashMismatchError
from loraplex.lora.expert_weights import expert_host_nbytes, max_expert_nbytes
from loraplex.lora.peft_format import AdapterInfo
from loraplex.lora.spec import LoRATargetSpec
from loraplex.lora.weights import AdapterWeights


@dataclass
class AdapterStats:
    """Per-adapter counters (``LoRAManager.stats``)."""

    loads: int = 0  # copies into a device slot
    evictions: int = 0  # removals from a device slot to make room
    host_loads: int = 0  # reads from disk into host memory
    host_evictions: int = 0
    load_seconds: float = 0.0  # disk reads + device copies
    requests: int = 0  # finished requests
    prompt_tokens: int = 0
    generation_tokens: int = 0


@dataclass
class AdapterRecord:
    adapter_id: str
    path: str  # local PEFT directory to (re)load from
    info: AdapterInfo
    display_name: str
    host_bytes: int  # what its AdapterWeights take in host memory (reservations, fit checks)
    names: set[str] = field(default_factory=set)
    outstanding: int = 0  # queued or running requests
    stats: AdapterStats = field(default_factory=AdapterStats)



@dataclass
class PreparedAdapter:
    """Adapter files read and validated ahead of ``resolve`` (see ``LoRAManager.read_ahead``)."""

    path: str  # absolute
    fingerprint: tuple  # of the files when they were read; resolve reads again if it changed
    weights: AdapterWeights
    read_seconds: float


def host_nbytes(info: AdapterInfo, spec: LoRATargetSpec, dtype: torch.dtype) -> int:
    """Bytes ``AdapterWeights`` of this adapter take in host memory (without reading it)."""
    elem = torch.empty(0, dtype=dtype).element_size()
    layers = sum(m.rank * sum(spec.module_shapes[m.module]) for m in info.modules.values())
    vocab = sum(m.rank * sum(spec.vocab_shapes[mod]) for mod, m in info.vocab_modules.items())
    experts = expert_host_nbytes(info.expert_modules, spec.experts, elem) if info.expert_modules else 0
    return elem * (layers + vocab) + experts


def max_adapter_host_nbytes(spec: LoRATargetSpec, rank: int, dtype: torch.dtype) -> int:
    """``host_nbytes`` of the largest adapter an engine serves: ``rank`` on every targetable
    projection of every layer, and on embed_tokens and lm_head where the model serves them, and
    on every expert's gate, up and down where the engine serves expert LoRA."""
    elem = torch.empty(0, dtype=dtype).element_size()
    layers = sum(spec.num_layers_with(m) * sum(shape) for m, shape in spec.module_shapes.items())
    dense = elem * rank * (layers + sum(sum(shape) for shape in spec.vocab_shapes.values()))
    return dense + max_expert_nbytes(spec.experts, rank, elem)


def host_budget_bytes(config: EngineConfig, spec: LoRATargetSpec, dtype: torch.dtype) -> int:
    """The host cache's byte budget. vLLM's ``max_cpu_loras`` counts adapters; loraplex budgets
    bytes, since adapters differ in size, so a count becomes room for that many of the largest
    adapters this engine serves (any mix of smaller ones fits too, usually more of them)."""
    if config.max_cpu_loras is not None:
        return config.max_cpu_loras * max_adapter_host_nbytes(spec, config.max_lora_rank, dtype)
    if config.max_cpu_lora_bytes is not None:
        return config.max_cpu_lora_bytes
    return DEFAULT_MAX_CPU_LORA_BYTES


def check_hash(path: str, adapter_id: str, expected: str | None) -> None:
    if expected is not None and expected != adapter_id:
        raise AdapterHashMismatchError(f"adapter at {path!r} hashes to {adapter_id}, expected {expected}")


def files_fingerprint(path: str) -> tuple:
    """(mtime_ns, size) of the adapter files, so an unchanged directory is not re-hashed."""
    out = []
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        try:
            st = os.stat(os.path.join(path, name))
            out.append((st.st_mtime_ns, st.st_size))
        except OSError:
            out.append(None)
    return tuple(out)
