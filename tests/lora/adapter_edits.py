"""Small helpers that copy a PEFT adapter directory and break one thing in it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file


def copy_adapter(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(src: Path, dst: Path, **changes) -> Path:
    """Copy ``src`` to ``dst`` with config fields changed (a value of ``...`` deletes the field)."""
    copy_adapter(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    for k, v in changes.items():
        if v is ...:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def edit_tensors(src: Path, dst: Path, fn) -> Path:
    """Copy ``src`` to ``dst`` with ``fn(dict name -> tensor)`` applied to the weights (in place)."""
    copy_adapter(src, dst)
    tensors = load_file(str(dst / "adapter_model.safetensors"))
    fn(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "adapter_model.safetensors"))
    return dst
