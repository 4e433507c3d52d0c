"""What ``loraplex serve`` (and ``sglang-serve``, which runs it) checks once its settings are
built and before anything starts: no registry opened, no key printed, no model read. Each value
here is taken by ``Settings`` (its form is right) but would fail later, after the model load or
as a traceback: a model that is not there, a device this machine lacks, a database or blob URL
nothing can open, a chat template that does not compile, the vLLM start-up flags' keys and
tenant, the TLS files (http_options.check). Every error names the flag.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from loraplex.config import Settings
from loraplex.server import http_options, vllm_flags


class StartupValueError(ValueError):
    """A value that cannot work on this machine; the message names its flag."""


# what check_before_start raises, each with a one-line message naming the flag
ERRORS = (StartupValueError, vllm_flags.VllmFlagError, http_options.HttpOptionsError)


def check_before_start(args: argparse.Namespace, settings: Settings,
                       environ: Mapping[str, str] | None = None) -> vllm_flags.StartupFlags:
    """The vLLM start-up flags (``--api-key``, ``--lora-modules``) once every check has passed;
    raises one of ``ERRORS`` for the first value that would fail later."""
    flags = vllm_flags.startup_flags(args, environ)
    if flags.given:
        _check_tenant(settings.vllm_tenant)
    for module in flags.lora_modules:  # the rest of a module's checks need the model's shapes
        if not Path(module.path).expanduser().is_dir():
            raise StartupValueError(f"--lora-modules {module.name}={module.path}: adapter path "
                                    f"{module.path!r} is not a directory")
    http_options.check(settings)  # a bad certificate path fails here, not after the model load
    check_model(settings.model, settings.home, settings.max_model_len, settings.quantization)
    # named as typed: vLLM's --dtype half is float16 in settings
    check_placement(settings.device, settings.dtype, getattr(args, "dtype", None) or settings.dtype)
    if settings.database_url is not None:
        check_database_url(settings.database_url)
    if settings.blob_url is not None:
        _check_blob_url(settings.blob_url)
    if settings.chat_template is not None:
        _check_chat_template(settings.chat_template)
    return flags


def check_model(model: str, home: Path, max_model_len: int | None = None, quantization: str | None = None) -> None:
    """The model is there and, where its config.json can be read without converting anything,
    serves ``max_model_len`` (else the engine checks it once the model is converted)."""
    from loraplex.model.config import ModelSpec
    from loraplex.model.gguf import ModelNotFoundError
    from loraplex.model.model_source import described_dir, locate_model

    try:
        source = locate_model(model)
    except ModelNotFoundError as exc:
        raise StartupValueError(f"--model: {exc}") from None
    directory = described_dir(source, home)
    if max_model_len is None or directory is None:
        return
    try:
        spec = ModelSpec.from_dir(directory, quantization=quantization)
    except (OSError, ValueError, KeyError):
        return  # a config the engine refuses, with its own message, when it loads the model
    try:
        spec.served_context_len(max_model_len)
    except ValueError as exc:
        raise StartupValueError(f"--max-model-len {max_model_len}: {exc}") from None


def check_placement(device: str, dtype: str, dtype_as_typed: str | None = None) -> None:
    """The device exists on this machine and the dtype runs on it, as the engine will ask."""
    from loraplex.engine.device_choice import resolve_device, resolve_dtype

    try:
        resolved = resolve_device(device)
    except (ValueError, RuntimeError) as exc:
        raise StartupValueError(f"--device {device}: {exc}") from None
    try:
        resolve_dtype(dtype, resolved)
    except ValueError as exc:
        raise StartupValueError(f"--dtype {dtype_as_typed or dtype}: {exc}") from None


def check_database_url(url: str) -> None:
    """The URL parses, names a dialect SQLAlchemy has and whose driver is installed. The URL is
    never repeated in the message: it may hold a password."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    from loraplex.registry.db import normalize_url

    try:
        make_url(normalize_url(url)).get_dialect().import_dbapi()
    except NoSuchModuleError as exc:  # an ArgumentError too: first
        raise StartupValueError(f"--database-url: {exc}") from None
    except ArgumentError:
        raise StartupValueError("--database-url: not a database URL (expected e.g. sqlite:////path/loraplex.db "
                                "or postgresql://user@host/db)") from None
    except ImportError as exc:
        raise StartupValueError(f"--database-url: its driver is not installed ({exc})") from None


def _check_blob_url(url: str) -> None:
    from loraplex.storage.base import check_blob_url

    try:
        check_blob_url(url)
    except ValueError as exc:
        raise StartupValueError(f"--blob-url: {exc}") from None


def _check_chat_template(value: str) -> None:
    from loraplex.server.chat_template import load_chat_template

    try:
        load_chat_template(value)
    except ValueError as exc:  # its messages name --chat-template
        raise StartupValueError(str(exc)) from None
    except OSError as exc:  # a file it cannot read
        raise StartupValueError(f"--chat-template {value!r}: {exc}") from None


def _check_tenant(name: str) -> None:
    from loraplex.registry.errors import InvalidName
    from loraplex.registry.names import validate_tenant_name

    try:
        validate_tenant_name(name)
    except InvalidName as exc:
        raise StartupValueError(f"--vllm-tenant {name!r}: {exc}") from None
