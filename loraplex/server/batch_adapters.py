"""The adapters a batch run names in ``model``: vLLM's ``--lora-modules name=path`` (PEFT
directories, for this run only, nothing written to the registry), then, with ``--tenant T``, the
tenant's adapters in the loraplex registry as that tenant resolves them online.

``BatchAdapters`` stands where the server's ``AdapterManager`` stands (``ctx.adapters``): the
same ``resolve(tenant, model, acquire=True)`` / ``release(content_hash)`` that admission calls.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from loraplex.lora.peft_format import inspect_adapter_dir
from loraplex.lora.spec import AdapterRef, LoRATargetSpec
from loraplex.registry.errors import NotFound


@dataclass(frozen=True)
class LoraModule:
    """One ``--lora-modules`` entry: the name ``model`` uses, and the PEFT directory."""

    name: str
    path: str


def parse_lora_module(text: str) -> LoraModule:
    """vLLM's two spellings: ``name=path``, or JSON ``{"name": ..., "path": ...}`` (its other
    keys, such as ``base_model_name``, are ignored). A ValueError says what is wrong."""
    if text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
        except ValueError:
            raise ValueError(f"--lora-modules {text!r}: not valid JSON") from None
        name, path = entry.get("name"), entry.get("path")
        if not isinstance(name, str) or not isinstance(path, str):
            raise ValueError(f'--lora-modules {text!r}: the JSON form needs "name" and "path", both strings')
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules {text!r}: expected name=path")
    name, path = name.strip(), path.strip()
    if not name or not path:
        raise ValueError(f"--lora-modules {text!r}: the name and the path must not be empty")
    return LoraModule(name, path)


class BatchAdapters:
    """``model`` -> adapter for a batch run: the run's own modules first, then ``fallback`` (the
    registry's ``AdapterManager``, with ``--tenant``), else 404 ``model_not_found``."""

    def __init__(self, modules: dict[str, AdapterRef], fallback=None):
        self.modules = modules
        self.fallback = fallback
        # content hash -> acquisitions made through the fallback, so that a release goes back
        # to it even when one of the run's modules has the same weights (and so the same hash)
        self._from_fallback: Counter[str] = Counter()

    @classmethod
    def load(cls, modules: list[LoraModule], spec: LoRATargetSpec, max_lora_rank: int, base_name: str,
             fallback=None) -> "BatchAdapters":
        """Validate every module against the base model before the run, as an upload is (a
        PEFT directory that does not fit is ``InvalidAdapterError``, a repeated name or the
        base model's name a ValueError)."""
        refs: dict[str, AdapterRef] = {}
        for module in modules:
            if module.name in refs:
                raise ValueError(f"{module.name!r} is given twice")
            if module.name == base_name:
                raise ValueError(f"{module.name!r} is the base model's name")
            path = Path(module.path).expanduser().resolve()
            info = inspect_adapter_dir(path, spec, max_lora_rank)
            refs[module.name] = AdapterRef(name=module.name, path=str(path), content_hash=info.content_hash)
        return cls(refs, fallback)

    def resolve(self, tenant: str, model_ref: str, *, acquire: bool = False) -> AdapterRef:
        ref = self.modules.get(model_ref)
        if ref is not None:
            return ref  # the run's own files: nothing to pin, nothing evicts or deletes them
        if self.fallback is None:
            raise NotFound(f"adapter {model_ref!r} not found")
        ref = self.fallback.resolve(tenant, model_ref, acquire=acquire)
        if acquire:
            self._from_fallback[ref.content_hash] += 1
        return ref

    def release(self, content_hash: str) -> None:
        if self._from_fallback[content_hash] > 0:
            self._from_fallback[content_hash] -= 1
            self.fallback.release(content_hash)
