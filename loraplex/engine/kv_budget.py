"""The KV cache's byte budget on a GPU, by one of two rules (the model runner applies it, less the
LoRA slot pool; see its module docstring, "KV budget").

* Default: ``kv_cache_memory_fraction`` of the memory free once the weights are loaded.
* ``gpu_memory_utilization`` U (vLLM's ``--gpu-memory-utilization``, SGLang's
  ``--mem-fraction-static``): this process may hold U of the GPU's total memory. vLLM v1
  (vllm/v1/worker/gpu_worker.py) refuses to start when less than ``U * total`` is free at start,
  and gives the KV cache ``U * total`` less what its own process holds besides (weights, the
  profiled activation peak, memory outside torch). loraplex runs no profiling forward: it counts
  what the process holds once the weights are in (free memory before loading them less free
  memory after), and leaves ``1 - DEFAULT_KV_CACHE_MEMORY_FRACTION`` of the rest for activations,
  the share the default rule leaves. Memory another process takes while the weights load is
  counted as this process's, so the result is never more than the default rule would give: with
  at least ``U * total`` free at start, ``U * total`` less what loading took is at most what is
  free after it.

Two processes at U = 0.45 on one GPU hold at most 0.45 of it each, so both fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.config import DEFAULT_KV_CACHE_MEMORY_FRACTION, GiB


@dataclass(frozen=True)
class DeviceMemory:
    """Free and total bytes of one GPU, as ``torch.cuda.mem_get_info`` reports them."""

    free: int
    total: int


@dataclass(frozen=True)
class KVBudget:
    """A KV budget in bytes (before the LoRA slot reserve) and the rule that gave it, for the log."""

    nbytes: int
    rule: str


def device_memory(device: torch.device) -> DeviceMemory:
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(free=int(free), total=int(total))


def memory_at_start(device: torch.device, utilization: float | None) -> DeviceMemory | None:
    """The GPU's memory before the weights load (None on CPU), after ``check_free_at_start``
    when ``utilization`` is given."""
    if device.type != "cuda":
        return None
    memory = device_memory(device)
    if utilization is not None:
        check_free_at_start(utilization, memory, device)
    return memory


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB"


def check_free_at_start(utilization: float, at_start: DeviceMemory, device: torch.device) -> None:
    """vLLM's start-up check: refuse when less than ``utilization`` of the GPU is free before the
    weights load (another process holds it), in vLLM's words."""
    requested = utilization * at_start.total
    if at_start.free < requested:
        raise ValueError(
            f"Free memory on device {device} ({at_start.free / GiB:.2f}/{at_start.total / GiB:.2f} GiB) on startup "
            f"is less than desired GPU memory utilization ({utilization}, {requested / GiB:.2f} GiB). Decrease GPU "
            "memory utilization or reduce GPU memory used by other processes."
        )


def fraction_budget(fraction: float, after_weights: DeviceMemory) -> KVBudget:
    """The default rule: ``fraction`` of the memory free once the weights are loaded."""
    nbytes = int(after_weights.free * fraction)
    return KVBudget(nbytes, f"kv_cache_memory_fraction {fraction} of the {_gib(after_weights.free)} free "
                            f"after loading the weights = {_gib(nbytes)}")


def utilization_budget(utilization: float, at_start: DeviceMemory, after_weights: DeviceMemory) -> KVBudget:
    """The ``gpu_memory_utilization`` rule (module docstring); raises ``ValueError`` when this
    process already holds all of ``utilization`` of the GPU once its weights are in."""
    requested = utilization * at_start.total
    # what loading took: weights, the allocator's cache, anything outside torch
    held = max(0, at_start.free - after_weights.free)
    within = requested - held
    if within <= 0:
        raise ValueError(
            f"gpu_memory_utilization {utilization} ({_gib(requested)} of {_gib(at_start.total)}) leaves no memory "
            f"for the KV cache: this process holds {_gib(held)} once the weights are loaded; raise "
            "gpu_memory_utilization or give kv_cache_bytes"
        )
    # never more than the default rule (0.9 of the free memory after loading): the start check
    # made requested <= at_start.free, so within = after_weights.free - (at_start.free - requested)
    nbytes = int(within * DEFAULT_KV_CACHE_MEMORY_FRACTION)
    return KVBudget(nbytes, f"gpu_memory_utilization {utilization} of {_gib(at_start.total)} = {_gib(requested)}, "
                            f"less {_gib(held)} this process holds after loading the weights, "
                            f"{1 - DEFAULT_KV_CACHE_MEMORY_FRACTION:.0%} of the rest left for activations = "
                            f"{_gib(nbytes)}")


def sizing_option(kv_cache_bytes: int | None, utilization: float | None, device: torch.device) -> str:
    """The option that sizes the KV cache (the one to raise when it is too small): a byte size when
    given; else ``gpu_memory_utilization`` on a GPU when given (``kv_cache_memory_fraction`` then
    changes nothing); else ``kv_cache_memory_fraction``."""
    if kv_cache_bytes is not None:
        return "kv_cache_bytes"
    if utilization is not None and device.type == "cuda":
        return "gpu_memory_utilization"
    return "kv_cache_memory_fraction"


def cpu_budget(fraction: float, cap: int, utilization: float | None) -> KVBudget:
    """``fraction`` of the CPU cap; a ``utilization`` has no GPU to size and changes nothing."""
    rule = f"kv_cache_memory_fraction {fraction} of the CPU cap ({cap} bytes)"
    if utilization is not None:
        rule = f"gpu_memory_utilization {utilization} has no GPU to size on CPU, the CPU cap applies: {rule}"
    return KVBudget(int(cap * fraction), rule)
