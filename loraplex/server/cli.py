"""``loraplex serve``: the HTTP server on embedded defaults, or on what flags and ``LORAPLEX_*``
settings say.

Every ``Settings`` field is a flag (``--max-loras 16`` for ``LORAPLEX_MAX_LORAS``); a flag wins over
the environment. A ``vllm serve`` command line runs too: vLLM's flags that mean the same are taken,
the others are refused with what to use instead (loraplex/server/vllm_flags.py); ``--api-key`` and
``--lora-modules`` become keys and adapters of the tenant ``--vllm-tenant`` before the server
listens (loraplex/server/vllm_startup.py). The admin key is
read from ``LORAPLEX_ADMIN_KEY`` only (a flag would show it in the process list); without it one is
generated at the first start, stored hashed and printed once. On the embedded default database a
``demo`` tenant and its key are created (and printed) at the first start.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import logging
import os
import re
import sys
import threading
import time
import types
import typing
from pathlib import Path

from loraplex.config import KV_CACHE_DTYPES, SCHEDULING_POLICIES, Settings
from loraplex.generation_defaults import GenerationConfigError
from loraplex.generation_defaults import check_options as check_generation_options
from loraplex.server import http_options, vllm_engine_flags, vllm_flags
from loraplex.server.reasoning_parsers import REASONING_PARSERS
from loraplex.server.tool_parsers import TOOL_PARSERS
from loraplex.template_content_format import CONTENT_FORMAT_OPTIONS

log = logging.getLogger(__name__)

# Settings fields that are not flags: secrets go through the environment only.
NOT_FLAGS = {"admin_key"}
# flags with a fixed set of values: argparse names them on a wrong one
CHOICES = {"tool_call_parser": list(TOOL_PARSERS), "reasoning_parser": list(REASONING_PARSERS),
           "prefix_cache_scope": ["tenant", "shared"], "tenant_limits_scope": ["replica", "cluster"],
           "scheduling_policy": list(SCHEDULING_POLICIES),
           "chat_template_content_format": list(CONTENT_FORMAT_OPTIONS), "kv_cache_dtype": list(KV_CACHE_DTYPES)}


# list settings take one value per flag, under a singular name: --lora-path-root A --lora-path-root B
LIST_FLAG_NAMES = {"lora_path_roots": (("--lora-path-root",), "DIR")}


def _flag_type(annotation):
    """(argparse type, is_bool) for a Settings field annotation such as ``int | None``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = args[0] if args else str
    if annotation is bool:
        return None, True
    if annotation in (int, float, str):
        return annotation, False
    if annotation is Path:
        return Path, False
    return str, False


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible multi-LoRA server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_settings_flags(p, skip=frozenset(http_options.FIELDS))
    vllm_flags.add_vllm_flags(p)
    http_options.add_http_flags(p)  # vLLM's front-end flags, their own help group
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--gc-debug", action="store_true",
                   help="log every full (generation-2) garbage collection: thread, pause, objects collected "
                   "(generations 0 and 1 too at --log-level debug)")
    # read by loraplex.cli before parsing (loraplex/server/vllm_config_file.py); here for --help
    p.add_argument("--config", dest="vllm_config", metavar="FILE.yaml",
                   help="vLLM's config file: flags as YAML keys (`max-loras: 4`); the command line wins")
    p.set_defaults(func=run_serve)


def add_settings_flags(parser: argparse.ArgumentParser, skip: frozenset[str] = frozenset()) -> None:
    """A flag for every ``Settings`` field but the secrets and ``skip`` (fields that mean nothing
    to the command); ``settings_from_args`` reads them back."""
    for name, field in Settings.model_fields.items():
        if name in NOT_FLAGS or name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        kind, is_bool = _flag_type(field.annotation)
        env = f"LORAPLEX_{name.upper()}"
        if is_bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                                help=f"(env {env})")
        elif typing.get_origin(field.annotation) is list:  # one value per use of the flag
            (item,) = typing.get_args(field.annotation)
            flags, metavar = LIST_FLAG_NAMES.get(name, ((flag,), None))
            parser.add_argument(*flags, dest=name, action="append", type=item, default=None, metavar=metavar,
                                help=f"repeatable (env {env}, a JSON list)")
        else:
            options = {"type": kind, "choices": CHOICES.get(name), **vllm_flags.SETTINGS_FLAG_OPTIONS.get(name, {})}
            aliases = vllm_flags.SETTINGS_FLAG_ALIASES.get(name, ())
            parser.add_argument(flag, *aliases, dest=name, default=None, help=f"(env {env})", **options)


def settings_from_args(args: argparse.Namespace, **fixed) -> Settings:
    """Settings from the environment and the flags (and ``fixed``, which win over both); raises
    ``VllmFlagError`` for a vLLM flag loraplex refuses, pydantic's ``ValidationError`` for values
    no setting takes, ``GenerationConfigError`` for generation config options that cannot be
    used. vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is read here, at the entry
    point (and ``VLLM_API_KEY`` in ``run_serve``), as vLLM reads them."""
    overrides = {
        name: getattr(args, name)
        for name in Settings.model_fields
        if name not in NOT_FLAGS and getattr(args, name, None) is not None
    }
    settings = Settings(**{**vllm_flags.translate(args, overrides, os.environ), **fixed})
    vllm_flags.check(args, settings)
    # before anything starts: the override, and a --generation-config folder's file (the model's
    # own file is read, and checked, when the engine loads the model)
    check_generation_options(settings.generation_config, settings.override_generation_config)
    return settings


def settings_or_error(args: argparse.Namespace, command: str = "serve", **fixed) -> Settings | None:
    """``settings_from_args``, or None after printing why not (as argparse prints its errors)."""
    try:
        return settings_from_args(args, **fixed)
    except Exception as exc:
        message = settings_error_message(exc, args)
        if message is None:
            raise
    print(f"loraplex {command}: error: {message}", file=sys.stderr)
    return None


def settings_error_message(exc: Exception, args: argparse.Namespace | None = None) -> str | None:
    """The message of an error ``settings_from_args`` (or ``startup_checks``) raises for values
    it refuses; None for any other exception. A setting is named as it was given: its flag
    (``--port``), or its environment variable when ``args`` shows no flag gave it."""
    from pydantic import ValidationError

    from loraplex.server import startup_checks

    if isinstance(exc, (vllm_flags.VllmFlagError, GenerationConfigError, *startup_checks.ERRORS)):
        return str(exc)
    if isinstance(exc, ValidationError):
        return "; ".join(setting_words(e, args) for e in exc.errors())
    return None


def setting_words(error: dict, args: argparse.Namespace | None) -> str:
    """One pydantic error of ``Settings`` in flag words: ``--port: Input should be ...`` for a
    field's own, a model validator's prose with each setting it names as its flag."""
    message = error["msg"].removeprefix("Value error, ")
    loc = error["loc"]
    if not loc:  # a model validator's: it names settings by field name
        return re.sub(r"\b[a-z]+(?:_[a-z]+)+\b", lambda m: _given_name(m.group(0), args), message)
    name = str(loc[0])
    if name in Settings.model_fields and args is not None and not _given_as_flag(args, name):
        return f"LORAPLEX_{name.upper()}: {message}"  # from the environment
    return f"{flag_name(name)}: {message}"


def _given_name(setting: str, args: argparse.Namespace | None) -> str:
    """A setting as the user gave it: its ``LORAPLEX_`` variable when no flag gave it and the
    environment holds it (a Deployment's env), else its flag."""
    if args is not None and setting in Settings.model_fields:
        from loraplex.server.startup_checks import SettingNames

        named = SettingNames(args, os.environ)
        if not named.from_flag(setting) and named.variable(setting) in os.environ:
            return named.variable(setting)
    return flag_name(setting)


def _given_as_flag(args: argparse.Namespace, name: str) -> bool:
    from loraplex.server.startup_checks import SettingNames

    return SettingNames(args, None).from_flag(name)


def flag_name(setting: str) -> str:
    """A Settings field's flag (itself when it is no field, or has no flag)."""
    if setting not in Settings.model_fields or setting in NOT_FLAGS:
        return setting
    return LIST_FLAG_NAMES.get(setting, (("--" + setting.replace("_", "-"),),))[0][0]


def _configure_logging(level: str, access_lines: bool = True) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)  # migration chatter at every start
    access = logging.getLogger("loraplex.access")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))  # the message is one JSON object
    access.addHandler(handler)
    # request lines are kept whatever --log-level says; --disable-uvicorn-access-log drops them
    access.setLevel(logging.INFO if access_lines else logging.CRITICAL + 1)
    access.propagate = False


def freeze_startup_objects() -> None:
    """Move every object alive once the server is up (torch, transformers, the model, the
    registry) to the garbage collector's permanent generation, as vLLM does after start-up.

    They are never garbage, yet each full collection scanned them all: ~314k objects, 145 ms on
    the 2-core VM with SmolLM2 loaded, a pause of every stream whenever enough request objects
    had outlived the young generations. After the freeze a full collection scans only what
    requests created (0.0 ms right after start-up). They are handed back at exit: objects still
    frozen then are never finalised, and Triton's nanobind bindings report each as a leak."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


class GcPauseLog:
    """``--gc-debug``: a ``gc.callbacks`` hook that logs how long each collection held the
    interpreter, in which thread, and what it freed; full collections at INFO, the young
    generations at DEBUG. Cheap enough to leave on under load: no object is counted."""

    def __init__(self, logger: logging.Logger = log):
        self.logger = logger
        self._started = 0.0  # collections never overlap: they hold the GIL from start to stop

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation = info["generation"]
        level = logging.INFO if generation == 2 else logging.DEBUG
        if self.logger.isEnabledFor(level):
            self.logger.log(level, "gc: generation %d collection in thread %s paused it %.1f ms, "
                            "collected %d (uncollectable %d), %d objects frozen", generation,
                            threading.current_thread().name, (time.perf_counter() - self._started) * 1000,
                            info["collected"], info["uncollectable"], gc.get_freeze_count())


def run_serve(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import OperationalError

    from loraplex.server.app import create_app
    from loraplex.server.components import prepare_registry
    from loraplex.server.lifecycle import DrainingServer
    from loraplex.server.startup_checks import ERRORS, check_before_start
    from loraplex.server.vllm_startup import StartupError, apply_startup_flags

    # the command the user typed, and the flags' names as typed: sglang-serve runs this too (sglang_cli.py)
    command = getattr(args, "serve_command", "serve")
    words = getattr(args, "serve_words", None) or str
    settings = settings_or_error(args, command)
    if settings is None:
        return 2
    try:  # before the registry opens and the model loads: a bad value fails at once
        flags = check_before_start(args, settings, os.environ)
    except ERRORS as exc:
        print(f"loraplex {command}: error: {words(str(exc))}", file=sys.stderr)
        return 2
    _configure_logging(args.log_level, access_lines=not args.disable_uvicorn_access_log)
    if args.gc_debug:  # process-wide, so here in the program and not in the library
        gc.callbacks.append(GcPauseLog())
    for note in vllm_engine_flags.notes(args):
        log.info("vLLM flag taken: %s", note)
    embedded = settings.database_url is None
    try:
        setup = prepare_registry(settings, create_demo=embedded)
    except OperationalError as exc:  # a database that does not answer: one line, not a traceback
        reason = str(exc.orig or exc).strip().splitlines()[0]  # the driver's words: never the URL's password
        print(f"loraplex {command}: error: --database-url: cannot open the database: {reason}", file=sys.stderr)
        return 2
    base = f"{http_options.scheme(settings)}://{settings.host}:{settings.port}"
    if setup.admin_secret:
        print(f"loraplex: admin key (shown once, stored hashed): {setup.admin_secret}", flush=True)
    for note in setup.notes:
        print(f"loraplex: {note}", flush=True)
    if setup.demo_key:
        print(f"loraplex: tenant 'demo' API key (shown once): {setup.demo_key}", flush=True)
        print(f"loraplex: OpenAI base URL for it: {base}/t/demo/v1", flush=True)
    server = None
    try:
        try:  # after the one-time secrets are printed, before the server listens
            outcome = apply_startup_flags(flags, settings, setup.registry)
        except StartupError as exc:
            print(f"loraplex {command}: error: {words(str(exc))}", file=sys.stderr)
            return 2
        for note in outcome.notes():
            print(f"loraplex: {note}", flush=True)
        if settings.allow_runtime_lora_updating and not settings.lora_path_roots:
            print("loraplex: runtime LoRA updating is on, but no --lora-path-root is given: every "
                  "POST /v1/load_lora_adapter is refused", flush=True)
        app = create_app(settings, registry=setup.registry, on_started=freeze_startup_objects)
        config = uvicorn_config(app, settings, args)
        server = DrainingServer(config, app.state.ctx.lifecycle, settings.shutdown_grace_seconds)
        server.run()
        return 0
    finally:
        if (setup.admin_secret or setup.demo_key) and not (server is not None and server.started):
            # the start failed after the first start's keys were printed: they are stored, and
            # the next start does not show them again
            print("loraplex: this start failed, but the keys printed above are stored and stay valid "
                  "(the next start does not show them again): keep them", file=sys.stderr)


def uvicorn_config(app, settings: Settings, args: argparse.Namespace):
    """The ``uvicorn.Config`` that ``loraplex serve`` runs ``app`` under. Its HTTP protocol is
    httptools (a dependency) with a bound on a request's head, unless
    ``--h11-max-incomplete-event-size`` asks for h11 and its limit."""
    import uvicorn

    from loraplex.server.http_protocol import BoundedHttpToolsProtocol

    protocol = {"http": BoundedHttpToolsProtocol, **vllm_engine_flags.uvicorn_options(args)}
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        **http_options.uvicorn_options(settings, args.log_level, args.uvicorn_log_level),  # TLS, root path
        **protocol,  # vLLM's --h11-max-incomplete-event-size: h11 and its limit
        access_log=False,  # one JSON line per request comes from loraplex.access instead
        lifespan="on",
        timeout_graceful_shutdown=1,
    )
