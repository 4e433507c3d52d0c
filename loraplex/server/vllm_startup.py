"""What ``loraplex serve --api-key ... --lora-modules ...`` does in the registry before the server
listens, so that a ``vllm serve`` deployment and its clients run unchanged.

Both flags act on one tenant, ``Settings.vllm_tenant`` (default ``default``), created when either
flag is given (a tenant an operator deleted is not: the start is refused, naming it, since
tenant names are never reused; start with another ``--vllm-tenant``). Clients then call
``/v1/...`` with one of the keys (the key picks the tenant, as every loraplex key does) and name
an adapter in ``model``.

* ``--api-key``: as ``RegistryService.sync_flag_keys`` (loraplex/registry/flag_keys.py). The
  tenant's keys stored by an earlier start and no longer listed are revoked, also when the flag
  is left out entirely: every replica serving that tenant must be started with the same keys.
  Other tenants' flag keys are left alone.
* ``--lora-modules``: every directory is checked first, exactly as an upload is (format, fit to
  the served model's shapes, ``--max-lora-rank``), so one invalid module stops the start with
  nothing registered. Then every blob is stored (``AdapterManager.store_then_register``: same
  content hash and blob as ``loraplex adapters upload``), and each version is added (identical
  weights already live add none) and made the name's active version; a changed directory
  becomes a new version and a hot-swap. Replicas starting at once end with one version per
  content (the registry's per-adapter lock and unique constraints).

All or nothing: the tenant, the keys and the modules' versions are written in one registry
transaction (``RegistryService.apply_serve_flags``, loraplex/registry/serve_flags.py) after the
blobs are stored. Any failure (a module's blob or rows, a refused key, a deleted tenant) writes
none of them, and the blobs this start stored are removed again: a failed start leaves no tenant,
key or module of its own behind, and a start never serves some of the modules.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.config import Settings
from loraplex.lora.errors import InvalidAdapterError
from loraplex.lora.peft_format import inspect_adapter_dir
from loraplex.lora.snapshot import adapter_snapshot
from loraplex.registry.errors import RegistryError
from loraplex.registry.flag_keys import flag_key_positions
from loraplex.registry.names import validate_tenant_name
from loraplex.server.vllm_flags import LoRAModule, StartupFlags
from loraplex.storage.base import BlobStoreError

MODULES_ACTOR = "serve --lora-modules"


class StartupError(Exception):
    """A vLLM flag that cannot be carried out; the message names the flag (never a key's text)."""


@dataclass
class ModuleOutcome:
    """One ``--lora-modules`` entry once registered."""

    name: str
    version: int
    sha256: str
    created: bool  # a new version (False: identical weights were already a live version)
    activated: bool  # the name now serves it and did not before


@dataclass
class StartupOutcome:
    """What the start-up did, for the lines ``loraplex serve`` prints."""

    tenant: str
    tenant_created: bool = False
    keys_added: int = 0
    keys_kept: int = 0
    keys_revoked: int = 0
    modules: list[ModuleOutcome] = field(default_factory=list)

    def notes(self) -> list[str]:
        lines = []
        if self.tenant_created:
            lines.append(f"tenant {self.tenant!r} created for the vLLM flags")
        if self.keys_added or self.keys_kept or self.keys_revoked:
            lines.append(f"--api-key: {self.keys_added} key(s) stored, {self.keys_kept} already stored, "
                         f"{self.keys_revoked} earlier --api-key key(s) revoked (tenant {self.tenant!r})")
        for m in self.modules:
            what = "new version" if m.created else "unchanged"
            swap = ", now active" if m.activated else ""
            lines.append(f"--lora-modules {m.name}: {self.tenant}/{m.name}@{m.version} ({what}{swap})")
        return lines


def apply_startup_flags(flags: StartupFlags, settings: Settings, registry, make_adapter_manager=None) -> StartupOutcome:
    """Carry out ``flags`` in ``registry`` (a ``RegistryService``), all or nothing: the tenant,
    the keys and the modules are written in one registry transaction
    (``RegistryService.apply_serve_flags``), after the modules' blobs are stored.
    ``make_adapter_manager()`` gives the ``AdapterManager`` the blobs go through (default: the
    one ``loraplex adapters upload`` builds, validating against the served model's config); it
    is called only when there are modules. Raises ``StartupError``."""
    tenant = settings.vllm_tenant
    # Each module's files are copied once, before the checks: the checks and the uploads read
    # the copies, so a directory changed or removed meanwhile cannot fail an upload after
    # earlier modules were registered, nor register bytes other than the checked ones.
    with ExitStack() as copies:
        try:
            if flags.given:  # checked as the transaction will, but before any blob is stored
                validate_tenant_name(tenant)
                flag_key_positions(list(flags.api_keys))
            manager = None
            checked: list[tuple[LoRAModule, Path]] = []
            if flags.lora_modules:
                manager = (make_adapter_manager or (lambda: _default_manager(settings, registry)))()
                for module in flags.lora_modules:  # all of them before anything is written
                    copy = copies.enter_context(_module_snapshot(module, getattr(manager, "snapshot_root", None)))
                    check_module(LoRAModule(module.name, str(copy)), manager, shown_path=module.path)
                    checked.append((module, copy))

            def write(versions, check_blob=None):
                return registry.apply_serve_flags(tenant, list(flags.api_keys), versions, create_tenant=flags.given,
                                                  uploader=MODULES_ACTOR, check_blob=check_blob)

            written = _register_modules(manager, tenant, checked, write) if checked else write([])
        except (RegistryError, BlobStoreError, InvalidAdapterError) as exc:
            raise StartupError(f"vLLM flags (tenant {tenant!r}): {exc}") from exc
    outcome = StartupOutcome(tenant, written.tenant_created, written.keys.added, written.keys.kept,
                             written.keys.revoked)
    outcome.modules = [ModuleOutcome(m.name, d.version.version, d.version.sha256, d.created, d.activated)
                       for (m, _), d in zip(checked, written.modules)]
    return outcome


def _register_modules(manager, tenant: str, checked: list[tuple[LoRAModule, Path]], write):
    """The checked modules' blobs stored, then ``write(versions, check_blob)`` (the start's one
    transaction). A failure of a module (its blob, its rows) is a ``StartupError`` naming the
    module when one failed and saying that none was registered; other errors (a key, the
    tenant) propagate."""
    try:
        return manager.store_then_register([(m.name, copy) for m, copy in checked], write)
    except (RegistryError, BlobStoreError, InvalidAdapterError) as exc:
        failed = getattr(exc, "adapter", None)
        if isinstance(exc, RegistryError) and failed is None:
            raise  # not about a module
        paths = {m.name: m.path for m, _ in checked}
        which = f" {failed}={paths[failed]}" if failed in paths else ""
        raise StartupError(f"--lora-modules{which} (tenant {tenant!r}): {exc}; none of the {len(checked)} "
                           "module(s) was registered") from exc


@contextmanager
def _module_snapshot(module: LoRAModule, temp_root: Path | None) -> Iterator[Path]:
    """``adapter_snapshot`` of a module's directory; ``StartupError`` naming the module."""
    try:
        snapshot = adapter_snapshot(Path(module.path).expanduser(), temp_root=temp_root)
        copy = snapshot.__enter__()
    except InvalidAdapterError as exc:
        raise StartupError(f"--lora-modules {module.name}={module.path}: {exc.message}") from None
    try:
        yield copy
    finally:
        snapshot.__exit__(None, None, None)


def check_module(module: LoRAModule, manager, shown_path: str | None = None) -> None:
    """The upload's checks on one module's directory; ``StartupError`` naming it (with
    ``shown_path``, the path given on the command line, when ``module.path`` is a copy) and the
    reason."""
    try:
        inspect_adapter_dir(Path(module.path).expanduser(), manager.spec, manager.max_lora_rank)
    except InvalidAdapterError as exc:
        raise StartupError(f"--lora-modules {module.name}={shown_path or module.path}: {exc.message}") from None


def _default_manager(settings: Settings, registry):
    from loraplex.registry.adapter_manager import build_adapter_manager
    from loraplex.registry.base_model import base_model_spec

    try:
        spec = base_model_spec(settings)
    except (OSError, ValueError) as exc:  # no config.json, or a GGUF header it cannot read
        raise StartupError(f"--lora-modules: cannot read the served model's config to check adapters: {exc}") from exc
    return build_adapter_manager(settings, registry, spec)
