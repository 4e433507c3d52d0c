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

from loraplex.config import Settings, make_home
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
    named = SettingNames(args, environ)
    check_model(settings.model, settings.home, settings.max_model_len, settings.quantization,
                model_name=named("model"), max_model_len_name=named("max_model_len"))
    # named as typed: vLLM's --dtype half is float16 in settings
    check_placement(settings.device, settings.dtype, named.value("dtype", settings.dtype),
                    device_name=named("device"), dtype_name=named("dtype"))
    if settings.database_url is not None:
        check_database_url(settings.database_url, named("database_url"))
    if settings.blob_url is not None:
        _check_blob_url(settings.blob_url, named("blob_url"))
    if settings.chat_template is not None:
        _check_chat_template(settings.chat_template, named("chat_template"))
    check_home(settings.home, named("home"))  # last: it makes the folder, once all else is right
    return flags


def check_home(home: Path, name: str = "--home") -> None:
    """``config.make_home``, its refusal naming the flag or variable."""
    try:
        make_home(home)
    except ValueError as exc:
        raise StartupValueError(f"{name} {exc}") from None


class SettingNames:
    """How the user gave a setting, to name it in an error: its flag (``--device``), or its
    ``LORAPLEX_`` variable when no flag gave it (a Deployment's env has no command line)."""

    def __init__(self, args: argparse.Namespace, environ: Mapping[str, str] | None):
        self.args = args
        self.environ = environ if environ is not None else {}

    def from_flag(self, setting: str) -> bool:
        return getattr(self.args, setting, None) is not None or (
            setting == "model" and getattr(self.args, "model_tag", None) is not None)

    def __call__(self, setting: str) -> str:
        if self.from_flag(setting) or self.variable(setting) not in self.environ:
            return "--" + setting.replace("_", "-")
        return self.variable(setting)

    def value(self, setting: str, default: str) -> str:
        """The value as typed (``half``, not the ``float16`` it means), flag or variable."""
        if self.from_flag(setting):
            return str(getattr(self.args, setting))
        return self.environ.get(self.variable(setting), default)

    @staticmethod
    def variable(setting: str) -> str:
        return f"LORAPLEX_{setting.upper()}"


def check_model(model: str, home: Path, max_model_len: int | None = None, quantization: str | None = None,
                *, model_name: str = "--model", max_model_len_name: str = "--max-model-len") -> None:
    """The model is there and, where its config.json can be read without converting anything,
    serves ``max_model_len`` (else the engine checks it once the model is converted)."""
    from loraplex.model.config import ModelSpec
    from loraplex.model.gguf import ModelNotFoundError
    from loraplex.model.model_source import described_dir, locate_model

    try:
        source = locate_model(model)
    except ModelNotFoundError as exc:
        raise StartupValueError(f"{model_name}: {exc}") from None
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
        raise StartupValueError(f"{max_model_len_name} {max_model_len}: {exc}") from None


def check_placement(device: str, dtype: str, dtype_as_typed: str | None = None, *,
                    device_name: str = "--device", dtype_name: str = "--dtype") -> None:
    """The device exists on this machine and the dtype runs on it, as the engine will ask."""
    from loraplex.engine.device_choice import resolve_device, resolve_dtype

    try:
        resolved = resolve_device(device)
    except (ValueError, RuntimeError) as exc:
        raise StartupValueError(f"{device_name} {device}: {exc}") from None
    try:
        resolve_dtype(dtype, resolved)
    except ValueError as exc:
        raise StartupValueError(f"{dtype_name} {dtype_as_typed or dtype}: {exc}") from None


def check_database_url(url: str, name: str = "--database-url") -> None:
    """The URL parses, names a dialect SQLAlchemy has and whose driver is installed. The URL is
    never repeated in the message: it may hold a password."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    from loraplex.registry.db import normalize_url

    try:
        make_url(normalize_url(url)).get_dialect().import_dbapi()
    except NoSuchModuleError as exc:  # an ArgumentError too: first
        raise StartupValueError(f"{name}: {exc}") from None
    except ArgumentError:
        raise StartupValueError(f"{name}: not a database URL (expected e.g. sqlite:////path/loraplex.db "
                                "or postgresql://user@host/db)") from None
    except ImportError as exc:
        raise StartupValueError(f"{name}: its driver is not installed ({exc})") from None


def _check_blob_url(url: str, name: str) -> None:
    from loraplex.storage.base import check_blob_url

    try:
        check_blob_url(url)
    except ValueError as exc:
        raise StartupValueError(f"{name}: {exc}") from None


def _check_chat_template(value: str, name: str) -> None:
    from loraplex.server.chat_template import load_chat_template

    try:
        load_chat_template(value)
    except ValueError as exc:  # its messages name --chat-template
        raise StartupValueError(str(exc).replace("--chat-template", name, 1)) from None
    except OSError as exc:  # a file it cannot read
        raise StartupValueError(f"{name} {value!r}: {exc}") from None


def _check_tenant(name: str) -> None:
    from loraplex.registry.errors import InvalidName
    from loraplex.registry.names import validate_tenant_name

    try:
        validate_tenant_name(name)
    except InvalidName as exc:
        raise StartupValueError(f"--vllm-tenant {name!r}: {exc}") from None
