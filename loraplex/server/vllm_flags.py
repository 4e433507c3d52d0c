"""A ``vllm serve`` command line on ``loraplex serve``: vLLM's flags where the meaning is the same,
and an error naming loraplex's way where it is not.

Most vLLM flags are loraplex settings under the same name (``--port``, ``--host``, ``--max-loras``,
``--max-lora-rank``, ``--max-cpu-loras``, ``--max-model-len``, ``--seed``, ``--dtype``...): they
are made from ``Settings`` (loraplex/server/cli.py). This module adds the rest:

* taken as in vLLM: the model as a positional argument (``vllm serve MODEL``), ``--enable-lora``
  (LoRA is always on), ``--enable-auto-tool-choice`` (needs a tool-call parser, as in vLLM; in
  loraplex the parser alone turns ``"auto"`` on), ``--enforce-eager`` (no CUDA graphs),
  ``--tensor-parallel-size 1``, ``--dtype half`` / ``float``, ``--max-model-len 32k`` (and
  ``--max-num-batched-tokens``) or ``auto``, one ``--served-model-name``, ``--chat-template`` (a
  setting, loraplex/server/chat_template.py), and ``--trust-remote-code`` / ``--disable-log-requests`` /
  ``--disable-log-stats`` / ``--enable-request-id-headers``, which ask for nothing loraplex does otherwise;
* taken into loraplex's tenant model: ``--api-key KEY [KEY ...]`` (API keys of the tenant
  ``--vllm-tenant``, default ``default``) and ``--lora-modules`` in both of vLLM's forms,
  ``name=path`` and ``{"name": ..., "path": ..., "base_model_name": ...}`` (adapters of that
  tenant, registered at start as uploads are); see loraplex/server/vllm_startup.py. vLLM's
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` turns on ``--allow-runtime-lora-updating`` and
  ``VLLM_API_KEY`` stands for ``--api-key``, so that a deployment's environment runs unchanged
  (the entry point passes its environment in; nothing here reads it);
* refused, with what to use instead: ``--tensor-parallel-size`` above 1, several served model names
  (``--quantization fp8`` and ``--gpu-memory-utilization`` are loraplex settings of the same
  meaning: loraplex/engine/kv_budget.py);
* every other flag of ``vllm serve`` (``--swap-space``, ``--task``, ``-O``,
  ``--rope-scaling`` ...): taken where the value means what loraplex does, refused otherwise, as
  one table says (loraplex/server/vllm_flag_table.py, read by vllm_engine_flags.py). vLLM's dotted
  JSON flags (``--compilation-config.level 3``) are merged before parsing (vllm_argv.py).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass

from loraplex.config import DTYPE_ALIASES, UNSERVED_KV_CACHE_DTYPES, Settings, unserved_kv_cache_dtype
from loraplex.registry.errors import InvalidName
from loraplex.registry.flag_keys import flag_key_positions
from loraplex.registry.names import validate_adapter_name
from loraplex.server import vllm_engine_flags
from loraplex.server.vllm_flag_kinds import human_readable_int


class VllmFlagError(ValueError):
    """A vLLM flag loraplex cannot honour as given; the message says what to use instead."""


# vLLM flags loraplex refuses: dest -> (option strings, argparse options, why and what instead)
REFUSED: dict[str, tuple[tuple[str, ...], dict, str]] = {
    "tensor_parallel_size": (
        ("--tensor-parallel-size", "-tp"), {"type": int},
        "loraplex runs a model on one device (--device cuda:N); to use more GPUs run one replica "
        "per GPU on a shared database and blob store (LORAPLEX_DATABASE_URL, LORAPLEX_BLOB_URL)",
    ),
}

@dataclass(frozen=True)
class LoRAModule:
    """One ``--lora-modules`` entry: adapter ``name`` served from the PEFT directory ``path``.
    ``base_model_name`` is taken from vLLM's JSON form and not used: the adapter is checked
    against the served model's shapes, and listed with the served model as its parent."""

    name: str
    path: str
    base_model_name: str | None = None


LORA_MODULE_FIELDS = {"name", "path", "base_model_name"}


def parse_lora_module(text: str) -> LoRAModule:
    """vLLM's two forms: ``name=path``, or a JSON object with ``name``, ``path`` and optionally
    ``base_model_name``. Raises ``argparse.ArgumentTypeError`` saying what is wrong."""
    if text.lstrip().startswith("{"):
        fields = vllm_engine_flags.json_object(text)
        unknown = sorted(set(fields) - LORA_MODULE_FIELDS)
        if unknown:
            raise argparse.ArgumentTypeError(f"{text!r}: unknown field(s) {', '.join(unknown)} "
                                             f"(fields: {', '.join(sorted(LORA_MODULE_FIELDS))})")
        name, path, base = fields.get("name"), fields.get("path"), fields.get("base_model_name")
        if not isinstance(base, (str, type(None))):
            raise argparse.ArgumentTypeError(f"{text!r}: base_model_name must be a string")
    elif "=" in text:
        name, path = text.split("=", 1)  # names cannot hold "=", paths can
        base = None
    else:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected name=path or a JSON object {{\"name\": ..., \"path\": ...}}")
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: needs a non-empty name and path")
    try:
        validate_adapter_name(name)
    except InvalidName as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return LoRAModule(name=name, path=path, base_model_name=base)


@dataclass(frozen=True)
class StartupFlags:
    """What the vLLM flags ask to be done in the registry before the server listens."""

    api_keys: tuple[str, ...] = ()
    lora_modules: tuple[LoRAModule, ...] = ()

    @property
    def given(self) -> bool:
        return bool(self.api_keys or self.lora_modules)


def startup_flags(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> StartupFlags:
    """``--api-key`` and ``--lora-modules`` from parsed arguments; raises ``VllmFlagError`` for a
    name given twice (vLLM would serve one of the two paths under it). Without ``--api-key``,
    vLLM's ``VLLM_API_KEY`` from ``environ`` (the entry point passes the process's) is the key, as
    in vLLM: a key kept out of the process list."""
    modules = tuple(getattr(args, "vllm_lora_modules", None) or ())
    seen: set[str] = set()
    for module in modules:
        if module.name in seen:
            raise VllmFlagError(f"--lora-modules: {module.name!r} is given twice; one path per name")
        seen.add(module.name)
    keys = tuple(getattr(args, "vllm_api_key", None) or ())
    if getattr(args, "model_tag", None) is None:
        for position, key in enumerate(keys, start=1):
            # `serve --api-key KEY ./model`: --api-key takes one or more values, so the model is
            # read as a second key and the default model served under a key anyone could guess
            if key.endswith(".gguf") or os.path.exists(key):
                raise VllmFlagError(
                    f"--api-key #{position} names an existing path: a model given after --api-key is read "
                    "as one more key; put the model first (`loraplex serve MODEL --api-key KEY`) or give --model")
    if not keys and (environ or {}).get("VLLM_API_KEY"):
        keys = (environ["VLLM_API_KEY"],)
    try:  # here, before the registry is opened, rather than when the keys are stored
        flag_key_positions(list(keys))
    except InvalidName as exc:
        raise VllmFlagError(str(exc)) from None
    return StartupFlags(api_keys=keys, lora_modules=modules)


def runtime_updating_from_env(environ: Mapping[str, str]) -> bool:
    """vLLM's switch for its runtime LoRA endpoints (its own parsing: ``1`` or ``true``)."""
    return environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


AUTO = "auto"


def model_len(text: str) -> int | str:
    """``--max-model-len``: ``human_readable_int``, or vLLM's ``auto`` / ``-1`` (the longest
    context the KV cache holds), which is what loraplex does when the flag is left out: the
    model's context, lowered to the KV cache's capacity at start."""
    if text.strip().lower() in (AUTO, "-1"):
        return AUTO
    return human_readable_int(text)


def kv_cache_dtype_name(text: str) -> str:
    """``--kv-cache-dtype``: vLLM's values that loraplex does not serve are refused by what they
    are (argparse's choices then name the values served)."""
    if text in UNSERVED_KV_CACHE_DTYPES:
        raise argparse.ArgumentTypeError(unserved_kv_cache_dtype(text))
    return text


# argparse options for some Settings flags, so that they take what vLLM's take
# vLLM's short spellings of flags that are loraplex settings
SETTINGS_FLAG_ALIASES: dict[str, tuple[str, ...]] = {"quantization": ("-q",)}
SETTINGS_FLAG_OPTIONS: dict[str, dict] = {
    "served_model_name": {"nargs": "+"},  # vLLM takes several; loraplex one (more are refused)
    "max_model_len": {"type": model_len},
    "max_num_batched_tokens": {"type": human_readable_int},
    "kv_cache_dtype": {"type": kv_cache_dtype_name},
}


def add_vllm_flags(parser: argparse.ArgumentParser, taken: frozenset[str] = frozenset(),
                   command: str = "serve") -> None:
    """The vLLM flags that are not loraplex settings (see the module doc); those named in
    ``taken`` (``api_key``, ``lora_modules`` or a ``REFUSED`` one) are left out, for the command
    to add as its own or not at all (``run-batch`` has its own ``--lora-modules`` and no keys);
    ``command`` ``run-batch`` adds vLLM's run_batch flags too."""
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                        help="the model, as in `vllm serve MODEL` (the same as --model)")
    group = parser.add_argument_group("vLLM flags", "taken so that a `vllm serve` command line runs")
    group.add_argument("--enable-lora", action="store_true", help="accepted: LoRA is always on")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='needs --tool-call-parser (which alone turns tool_choice "auto" on)')
    group.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (--no-cuda-graphs)")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="accepted: loraplex runs its own model code, never code from a model directory")
    group.add_argument("--disable-log-requests", action="store_true",
                       help="accepted: loraplex logs no prompts (one access line of counts per request)")
    group.add_argument("--disable-log-stats", action="store_true",
                       help="accepted: loraplex logs no periodic engine statistics (they are on /metrics)")
    group.add_argument("--enable-request-id-headers", action="store_true",
                       help="accepted: every response carries x-request-id (and a client's own X-Request-Id "
                            "comes back as x-client-request-id)")
    if "api_key" not in taken:
        group.add_argument("--api-key", dest="vllm_api_key", nargs="+", action="extend", metavar="KEY",
                           help="API key(s) of the --vllm-tenant tenant, stored hashed; keys an earlier "
                                "start stored and this command line no longer lists are revoked")
    if "lora_modules" not in taken:
        group.add_argument("--lora-modules", dest="vllm_lora_modules", nargs="+", action="extend",
                           type=parse_lora_module, metavar="MODULE",
                           help='name=path or {"name": ..., "path": ...}: registered in the --vllm-tenant '
                                "tenant at start (a changed directory becomes the name's new active version)")
    vllm_engine_flags.add_engine_flags(group, command)
    for dest, (flags, options, _) in REFUSED.items():
        if dest in taken:
            continue
        hint = "1 is taken; more is refused" if dest == "tensor_parallel_size" else "refused"
        group.add_argument(*flags, dest=f"vllm_{dest}", default=None, metavar=dest.split("_")[-1].upper(),
                           help=f"{hint} (the error says what to use instead)", **options)


def translate(args: argparse.Namespace, overrides: dict, environ: Mapping[str, str] | None = None) -> dict:
    """``overrides`` (Settings fields from flags) with the vLLM flags' meaning applied; raises
    ``VllmFlagError`` naming every refused flag. ``environ`` is read for vLLM's
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` only (the entry point passes the process's)."""
    refused = [f"{REFUSED[dest][0][0]}: {REFUSED[dest][2]}" for dest in REFUSED if _is_refused(args, dest)]
    refused += vllm_engine_flags.refusals(args)
    if refused:
        raise VllmFlagError("vLLM flag(s) loraplex does not take:\n  " + "\n  ".join(refused))
    out = dict(overrides)
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if out.get("model", tag) != tag:
            raise VllmFlagError(f"two models given: {tag!r} (positional) and --model {out['model']!r}")
        out["model"] = tag
    names = out.get("served_model_name")
    if isinstance(names, list):
        if len(names) > 1:
            raise VllmFlagError(
                f"--served-model-name: loraplex serves the base model under one name, not "
                f"{len(names)} ({', '.join(names)}); "
                "adapters are named when they are uploaded (`loraplex adapters upload --name NAME`)"
            )
        out["served_model_name"] = names[0]
    if out.get("max_model_len") == AUTO:
        out["max_model_len"] = None  # over LORAPLEX_MAX_MODEL_LEN too: the flag wins
    if "dtype" in out:
        out["dtype"] = DTYPE_ALIASES.get(out["dtype"], out["dtype"])
    if getattr(args, "enforce_eager", False):
        if out.get("cuda_graphs"):
            raise VllmFlagError("--enforce-eager turns CUDA graphs off and --cuda-graphs on: give one")
        out["cuda_graphs"] = False  # also over LORAPLEX_CUDA_GRAPHS=true
    async_scheduling = getattr(args, "vllm_async_scheduling", None)
    if async_scheduling is not None:  # vLLM's: the host's share of a step overlaps the next one's device work
        for option in ("overlap_outputs", "schedule_ahead"):
            if out.get(option, async_scheduling) != async_scheduling:
                flag = option.replace("_", "-")
                raise VllmFlagError(f"--[no-]async-scheduling and --[no-]{flag} disagree: give one")
            out[option] = async_scheduling
    if "allow_runtime_lora_updating" not in out and runtime_updating_from_env(environ or {}):
        out["allow_runtime_lora_updating"] = True
    try:
        return vllm_engine_flags.apply(args, out)
    except ValueError as exc:
        raise VllmFlagError(str(exc)) from None


def check(args: argparse.Namespace, settings: Settings) -> None:
    """What vLLM checks once everything is known (a tool-call parser may come from the
    environment; the flags whose meaning depends on the model)."""
    if getattr(args, "enable_auto_tool_choice", False) and settings.tool_call_parser is None:
        # vLLM's words ("Error: --enable-auto-tool-choice requires --tool-call-parser")
        raise VllmFlagError("--enable-auto-tool-choice requires --tool-call-parser")
    refused = vllm_engine_flags.model_refusals(args, settings.model, settings.max_model_len,
                                               settings.reasoning_parser, settings.kv_cache_dtype)
    if refused:
        raise VllmFlagError("vLLM flag(s) loraplex does not take:\n  " + "\n  ".join(refused))


def _is_refused(args: argparse.Namespace, dest: str) -> bool:
    value = getattr(args, f"vllm_{dest}", None)
    if dest == "tensor_parallel_size":
        return value not in (None, 1)  # one device is what loraplex does
    return value is not None
