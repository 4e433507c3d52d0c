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
  ``--disable-log-stats``, which ask for nothing loraplex does otherwise;
* refused, with what to use instead: ``--gpu-memory-utilization``, ``--tensor-parallel-size`` above
  1, ``--lora-modules``, ``--api-key``, ``--quantization``, several served model names.
"""

from __future__ import annotations

import argparse
import re

from loraplex.config import Settings


class VllmFlagError(ValueError):
    """A vLLM flag loraplex cannot honour as given; the message says what to use instead."""


# vLLM flags loraplex refuses: dest -> (option strings, argparse options, why and what instead)
REFUSED: dict[str, tuple[tuple[str, ...], dict, str]] = {
    "gpu_memory_utilization": (
        ("--gpu-memory-utilization",), {"type": float},
        "vLLM's fraction of all GPU memory (weights, activations and KV cache) has no exact "
        "equivalent; loraplex sizes the KV cache alone: use --kv-cache-memory-fraction F (of the "
        "memory free once the weights are loaded) or --kv-cache-bytes N",
    ),
    "tensor_parallel_size": (
        ("--tensor-parallel-size", "-tp"), {"type": int},
        "loraplex runs a model on one device (--device cuda:N); to use more GPUs run one replica "
        "per GPU on a shared database and blob store (LORAPLEX_DATABASE_URL, LORAPLEX_BLOB_URL)",
    ),
    "lora_modules": (
        ("--lora-modules",), {"nargs": "+"},
        "adapters live in the registry: upload each once with `loraplex adapters upload --tenant T "
        "--name NAME PATH` (or POST /admin/v1/tenants/{t}/adapters/{name}/versions); requests then "
        "name it in `model`, across restarts and replicas (`loraplex run-batch` takes --lora-modules "
        "for an offline batch)",
    ),
    "api_key": (
        ("--api-key",), {"nargs": "+"},
        "API keys belong to tenants and are stored hashed: make one with `loraplex tenants "
        "create-key TENANT` (or POST /admin/v1/tenants/{t}/keys); the admin key is read from "
        "LORAPLEX_ADMIN_KEY",
    ),
    "quantization": (
        ("--quantization", "-q"), {},
        "loraplex serves unquantized weights: use --dtype bfloat16, float16 or float32 (a GGUF "
        "--model is dequantized when it is loaded)",
    ),
}

# vLLM's other names for dtypes (its --dtype choices)
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def human_readable_int(text: str) -> int:
    """vLLM's ``--max-model-len`` values: ``4096``, or with a suffix: ``k``/``m``/``g`` are powers
    of 1000 (decimals allowed: ``25.6k``), ``K``/``M``/``G`` powers of 1024 (whole numbers)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG])", text.strip())
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer: {text!r}") from None
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmg".index(suffix) + 1))
    if "." in number:
        raise argparse.ArgumentTypeError(f"{text!r}: a binary suffix ({suffix}) takes a whole number")
    return int(number) * 1024 ** ("KMG".index(suffix) + 1)


AUTO = "auto"


def model_len(text: str) -> int | str:
    """``--max-model-len``: ``human_readable_int``, or vLLM's ``auto`` / ``-1`` (the longest
    context the KV cache holds), which is what loraplex does when the flag is left out: the
    model's context, lowered to the KV cache's capacity at start."""
    if text.strip().lower() in (AUTO, "-1"):
        return AUTO
    return human_readable_int(text)


# argparse options for some Settings flags, so that they take what vLLM's take
SETTINGS_FLAG_OPTIONS: dict[str, dict] = {
    "served_model_name": {"nargs": "+"},  # vLLM takes several; loraplex one (more are refused)
    "max_model_len": {"type": model_len},
    "max_num_batched_tokens": {"type": human_readable_int},
}


def add_vllm_flags(parser: argparse.ArgumentParser, taken: frozenset[str] = frozenset()) -> None:
    """The vLLM flags that are not loraplex settings (see the module doc); those of ``REFUSED``
    named in ``taken`` are left for the command to add as its own (``run-batch`` takes
    ``--lora-modules``)."""
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                        help="the model, as in `vllm serve MODEL` (the same as --model)")
    group = parser.add_argument_group("vLLM flags", "taken so that a `vllm serve` command line runs")
    group.add_argument("--enable-lora", action="store_true", help="accepted: LoRA is always on")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='needs --tool-call-parser (which alone turns tool_choice "auto" on)')
    group.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (--no-cuda-graphs)")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="accepted: loraplex runs its own model code, never code from a model directory")
    group.add_argument("--disable-log-requests", "--disable-log-stats", action="store_true",
                       help="accepted: loraplex logs no prompts (one access line of counts per request)")
    for dest, (flags, options, _) in REFUSED.items():
        if dest in taken:
            continue
        hint = "1 is taken; more is refused" if dest == "tensor_parallel_size" else "refused"
        group.add_argument(*flags, dest=f"vllm_{dest}", default=None, metavar=dest.split("_")[-1].upper(),
                           help=f"{hint} (the error says what to use instead)", **options)


def translate(args: argparse.Namespace, overrides: dict) -> dict:
    """``overrides`` (Settings fields from flags) with the vLLM flags' meaning applied; raises
    ``VllmFlagError`` naming every refused flag."""
    refused = [f"{REFUSED[dest][0][0]}: {REFUSED[dest][2]}" for dest in REFUSED if _is_refused(args, dest)]
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
    return out


def check(args: argparse.Namespace, settings: Settings) -> None:
    """What vLLM checks once everything is known (a tool-call parser may come from the
    environment)."""
    if getattr(args, "enable_auto_tool_choice", False) and settings.tool_call_parser is None:
        # vLLM's words ("Error: --enable-auto-tool-choice requires --tool-call-parser")
        raise VllmFlagError("--enable-auto-tool-choice requires --tool-call-parser")


def _is_refused(args: argparse.Namespace, dest: str) -> bool:
    value = getattr(args, f"vllm_{dest}", None)
    if dest == "tensor_parallel_size":
        return value not in (None, 1)  # one device is what loraplex does
    return value is not None
