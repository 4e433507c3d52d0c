"""Which device and dtype an engine runs on (``EngineConfig.device`` / ``dtype``), and how much
memory the host has: the choices ``ModelRunner`` makes before it loads anything."""

from __future__ import annotations

import os

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} requested but this machine has {torch.cuda.device_count()} CUDA "
                         f"device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}; use auto, cpu or cuda[:N]")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use auto, {', '.join(DTYPES)}")
    if device.type == "cpu" and name == "float16":
        raise ValueError("float16 is not supported on CPU; use float32 or bfloat16")
    return DTYPES[name]


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); total physical memory elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
