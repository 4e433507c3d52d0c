"""``loraplex tenants ...`` and ``loraplex adapters ...``: manage the registry without a server.

``loraplex tenants set NAME --max-concurrent-requests N|default --scheduling-weight W
--max-requests-per-minute N|unlimited --max-tokens-per-minute N|unlimited`` changes a tenant's
serving limits; running servers apply them within ``registry_poll_seconds``. ``loraplex tenants
delete NAME --yes`` offboards a tenant (``RegistryService.delete_tenant``): running servers refuse
its keys and drop its weights from their engines within ``registry_poll_seconds``; without
``--yes`` it only says what would be deleted.

They work on whatever ``Settings`` name (``LORAPLEX_HOME``, ``LORAPLEX_DATABASE_URL``,
``LORAPLEX_BLOB_URL``): by default the embedded SQLite database and blob directory under
``LORAPLEX_HOME``, migrated on first use. A running server on the same database sees the changes
(hot-swaps within ``registry_poll_seconds``).

Uploads are validated against the served base model (``LORAPLEX_MODEL``); see
``loraplex.registry.base_model``; ``--base-config path/to/config.json`` overrides it.
"""

from __future__ import annotations

import argparse
import json
import sys

from loraplex.config import Settings, make_home
from loraplex.lora.spec import LoRATargetSpec
from loraplex.registry.base_model import base_model_spec
from loraplex.registry.errors import RegistryError
from loraplex.sampling_params import InvalidRequestError
from loraplex.storage.base import BlobStoreError


def add_parser(subparsers) -> None:
    tenants = subparsers.add_parser("tenants", help="create and list tenants, make API keys")
    tsub = tenants.add_subparsers(dest="tenants_command", required=True)
    p = tsub.add_parser("create", help="create a tenant")
    p.add_argument("name")
    p.set_defaults(func=_tenants_create)
    p = tsub.add_parser("list", help="list tenants")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_tenants_list)
    p = tsub.add_parser("create-key", help="create an API key for a tenant (the secret is printed once)")
    p.add_argument("name")
    p.set_defaults(func=_tenants_create_key)
    p = tsub.add_parser("set", help="set a tenant's concurrency cap, scheduling weight and rate limits "
                                    "(servers apply them live)")
    p.add_argument("name")
    # SUPPRESS: left out, the attribute is missing, so "default" (None) is told apart from not given
    p.add_argument("--max-concurrent-requests", type=_cap_or_default, metavar="N|default", default=argparse.SUPPRESS,
                   help="requests of the tenant in flight at once per replica; 'default': the server's "
                        "--max-concurrent-requests-per-tenant")
    p.add_argument("--scheduling-weight", type=float, metavar="W",
                   help="the tenant's share under the fair scheduling policy (default 1; 2: twice a weight-1 tenant's)")
    p.add_argument("--max-requests-per-minute", type=_limit_or_unlimited, metavar="N|unlimited",
                   default=argparse.SUPPRESS, help="requests the tenant may start per minute on each replica")
    p.add_argument("--max-tokens-per-minute", type=_limit_or_unlimited, metavar="N|unlimited",
                   default=argparse.SUPPRESS,
                   help="prompt tokens plus max_tokens x n the tenant may reserve per minute on each replica "
                        "(the unused part of max_tokens comes back when a request ends)")
    p.set_defaults(func=_tenants_set)
    p = tsub.add_parser("delete", help="delete a tenant: revoke its keys, delete its adapters (the name is never reused)")
    p.add_argument("name")
    p.add_argument("--yes", action="store_true",
                   help="really delete; without it, say what would be deleted and change nothing")
    p.set_defaults(func=_tenants_delete)

    adapters = subparsers.add_parser("adapters", help="upload, list, activate and delete LoRA adapters")
    asub = adapters.add_subparsers(dest="adapters_command", required=True)
    p = asub.add_parser("upload", help="upload a PEFT adapter directory as a new version")
    _tenant_name(p)
    p.add_argument("path", help="PEFT directory (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("--base-config", help="config.json of the base model to validate against")
    p.add_argument("--uploader", default="cli", help="recorded as the uploader (default: cli)")
    p.add_argument("--activate", action="store_true", help="make the new version active at once")
    p.set_defaults(func=_adapters_upload)
    p = asub.add_parser("list", help="list a tenant's adapters and versions")
    p.add_argument("--tenant", required=True)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_adapters_list)
    p = asub.add_parser("activate", help="point an adapter name at a version (hot-swap)")
    _tenant_name(p)
    p.add_argument("--version", required=True, type=int)
    p.set_defaults(func=_adapters_activate)
    p = asub.add_parser("delete", help="delete an adapter, or one version of it")
    _tenant_name(p)
    p.add_argument("--version", type=int, help="only this version (not the active one)")
    p.set_defaults(func=_adapters_delete)
    p = asub.add_parser("gc", help="delete blobs no adapter version uses (left by crashes)")
    p.add_argument("--min-age-seconds", type=_non_negative_seconds, default=3600.0,
                   help="keep blobs younger than this; uploads in progress store the blob first (default 3600)")
    p.set_defaults(func=_adapters_gc)


def _cap_or_default(text: str) -> int | None:
    """``--max-concurrent-requests``: an integer, or ``default`` (stored as null)."""
    if text == "default":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'default', got {text!r}") from None


def _limit_or_unlimited(text: str) -> int | None:
    """``--max-requests-per-minute`` and ``--max-tokens-per-minute``: an integer, or
    ``unlimited`` (stored as null)."""
    if text == "unlimited":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'unlimited', got {text!r}") from None


def _tenant_name(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tenant", required=True)
    parser.add_argument("--name", required=True, help="adapter name")


# -- plumbing -----------------------------------------------------------------------------------


def _registry(settings: Settings):
    from loraplex.registry.db import upgrade
    from loraplex.registry.service import RegistryService

    try:  # one line naming it, where the first write under it was a traceback
        make_home(settings.home)
    except ValueError as exc:
        raise ValueError(f"LORAPLEX_HOME {exc}") from None
    url = settings.resolved_database_url()
    upgrade(url)
    return RegistryService.from_url(url)


def _manager(settings: Settings, spec: LoRATargetSpec | None = None):
    from loraplex.registry.adapter_manager import build_adapter_manager

    # Deletes need no base model; a placeholder spec keeps them from loading one.
    spec = spec or LoRATargetSpec(model_name=str(settings.model), num_layers=0, module_shapes={})
    return build_adapter_manager(settings, _registry(settings), spec)


def _non_negative_seconds(text: str) -> float:
    value = float(text)  # argparse turns a ValueError into "invalid value"
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def _run(func):
    """Turn the expected failures into one ``error: ...`` line and exit status 1."""

    def wrapper(args) -> int:
        try:
            return func(args, Settings()) or 0
        except (RegistryError, InvalidRequestError, BlobStoreError, FileNotFoundError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1

    return wrapper


def _print_json(data) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str))


# -- tenants ------------------------------------------------------------------------------------


@_run
def _tenants_create(args, settings: Settings) -> int:
    tenant = _registry(settings).create_tenant(args.name, actor="cli")
    print(f"created tenant {tenant.name}")
    return 0


@_run
def _tenants_list(args, settings: Settings) -> int:
    tenants = _registry(settings).list_tenants()
    if args.json:
        _print_json([t.to_dict() for t in tenants])
    else:
        for t in tenants:
            print(f"{t.name}\t{t.created_at:%Y-%m-%d %H:%M:%S}\t{_settings_text(t)}")
    return 0


def _settings_text(tenant) -> str:
    cap = "default" if tenant.max_concurrent_requests is None else tenant.max_concurrent_requests
    rates = [(f, getattr(tenant, f)) for f in ("max_requests_per_minute", "max_tokens_per_minute")]
    return (f"max_concurrent_requests={cap}\tscheduling_weight={tenant.scheduling_weight:g}\t"
            + "\t".join(f"{f}={'unlimited' if v is None else v}" for f, v in rates))


@_run
def _tenants_set(args, settings: Settings) -> int:
    changes = {}
    if hasattr(args, "max_concurrent_requests"):
        changes["max_concurrent_requests"] = args.max_concurrent_requests
    if args.scheduling_weight is not None:
        changes["scheduling_weight"] = args.scheduling_weight
    for field in ("max_requests_per_minute", "max_tokens_per_minute"):
        if hasattr(args, field):  # SUPPRESSed when not given: "unlimited" is None, and is a change
            changes[field] = getattr(args, field)
    tenant = _registry(settings).update_tenant_settings(args.name, changes, actor="cli")
    print(f"tenant {tenant.name}: {_settings_text(tenant)}".replace("\t", " "))
    return 0


@_run
def _tenants_create_key(args, settings: Settings) -> int:
    info, secret = _registry(settings).create_api_key(args.name, actor="cli")
    print(f"API key {info.id} for tenant {info.tenant} (shown once, keep it):")
    print(secret)
    return 0


@_run
def _tenants_delete(args, settings: Settings) -> int:
    """Without ``--yes`` a dry run: what would go, exit status 1 (a typo must not offboard)."""
    if not args.yes:
        registry = _registry(settings)
        keys = [k for k in registry.list_api_keys(args.name) if not k.revoked]  # NotFound: unknown tenant
        adapters = registry.list_adapters(args.name)
        versions = sum(len(a.versions) for a in adapters)
        print(f"error: deleting tenant {args.name} revokes {len(keys)} API key(s) and deletes {len(adapters)} "
              f"adapter(s) ({versions} version(s)); the name can never be used again. Nothing changed: "
              "run again with --yes to delete it", file=sys.stderr)
        return 1
    deletion = _manager(settings).delete_tenant(args.name, actor="cli")
    counts = deletion.counts()
    print(f"deleted tenant {args.name}: {counts['api_keys_revoked']} API key(s) revoked, "
          f"{counts['adapters_deleted']} adapter(s) and {counts['versions_deleted']} version(s) deleted")
    return 0


# -- adapters -----------------------------------------------------------------------------------


@_run
def _adapters_upload(args, settings: Settings) -> int:
    try:
        spec = base_model_spec(settings, args.base_config)
    except (OSError, ValueError) as exc:
        if args.base_config is None:
            raise
        raise ValueError(f"--base-config {args.base_config}: {exc}") from None
    manager = _manager(settings, spec)
    version, created = manager.upload(args.tenant, args.name, args.path, uploader=args.uploader)
    if args.activate:
        version = manager.registry.activate(args.tenant, args.name, version.version, actor=args.uploader)
    verb = "uploaded" if created else "identical to existing"
    print(
        f"{verb} {args.tenant}/{version.ref} sha256={version.sha256} rank={version.rank} "
        f"targets={','.join(version.targets)} bytes={version.size_bytes}"
    )
    return 0


@_run
def _adapters_list(args, settings: Settings) -> int:
    adapters = _registry(settings).list_adapters(args.tenant)
    if args.json:
        _print_json([a.to_dict() for a in adapters])
        return 0
    for adapter in adapters:
        print(f"{adapter.name}\tactive={adapter.active_version}")
        for v in adapter.versions:
            mark = "*" if v.version == adapter.active_version else " "
            print(
                f"  {mark} v{v.version}\tsha256={v.sha256[:16]}\trank={v.rank}\t"
                f"targets={','.join(v.targets)}\tbytes={v.size_bytes}\t{v.created_at:%Y-%m-%d %H:%M:%S}\t{v.uploader}"
            )
    return 0


@_run
def _adapters_activate(args, settings: Settings) -> int:
    version = _registry(settings).activate(args.tenant, args.name, args.version, actor="cli")
    print(f"{args.tenant}/{args.name} now serves version {version.version} (sha256={version.sha256})")
    return 0


@_run
def _adapters_delete(args, settings: Settings) -> int:
    manager = _manager(settings)
    if args.version is None:
        removed = manager.delete_adapter(args.tenant, args.name, actor="cli")
    else:
        removed = manager.delete_version(args.tenant, args.name, args.version, actor="cli")
    print(f"deleted {args.tenant}/{args.name} versions {', '.join(str(v.version) for v in removed) or '(none)'}")
    return 0


@_run
def _adapters_gc(args, settings: Settings) -> int:
    deleted = _manager(settings).collect_garbage(args.min_age_seconds)
    print(f"deleted {len(deleted)} unreferenced blob(s)")
    for key in deleted:
        print(f"  {key}")
    return 0
