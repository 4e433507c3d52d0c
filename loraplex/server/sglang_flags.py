"""``python -m sglang.launch_server``'s common serving flags (sgl-project/sglang
``srt/server_args.py``, docs.sglang.io "Server Arguments"), read into a ``loraplex serve``
command line.

Each flag in ``TABLE`` is one of:

- taken with its loraplex meaning: it becomes the ``serve`` flag that means the same
  (``--model-path`` is ``--model``, ``--lora-paths a=/p`` is ``--lora-modules a=/p``,
  ``--max-loras-per-batch`` is ``--max-loras``, ``--context-length`` is ``--max-model-len``,
  ``--max-running-requests`` is ``--max-num-seqs``, ``--mem-fraction-static`` is
  ``--gpu-memory-utilization``, ``--disable-radix-cache`` is
  ``--no-enable-prefix-caching``, ``--tp`` is vLLM's ``--tensor-parallel-size``, which takes 1
  and refuses more ...); the ``serve`` flag then checks the value as it checks its own;
- taken as a no-op, with a line in the log saying why nothing changes (``--lora-backend``:
  loraplex's own kernels; ``--lora-target-modules``: each adapter's own targets;
  ``--enable-metrics``: ``/metrics`` is always served ...): only flags that do not change what a
  request generates;
- refused, naming the flag and what to use instead (``--max-total-tokens``, ``--is-embedding`` ...).

Flags not in the table go to ``serve`` as they are, so loraplex's own flags
(``--kv-cache-memory-fraction``, ``--max-cpu-loras`` ...) can follow SGLang's; a flag neither
knows is argparse's error with the closest flag of both.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field

from loraplex.flag_suggestions import unrecognized_message


class SGLangFlagError(ValueError):
    """A SGLang flag loraplex refuses (or a value it cannot take); the message says what to use."""


@dataclass(frozen=True)
class SGLangFlag:
    """One row: SGLang's spellings, how many values, and what becomes of it."""

    names: tuple[str, ...]
    nargs: str | None = None  # None: one value; "0": a switch; "+": a list
    to: Callable[[object], list[str]] | None = None  # the serve arguments it becomes
    note: str | None = None  # taken as a no-op: why nothing changes
    refuse: str | None = None  # refused: what to use instead

    @property
    def dest(self) -> str:
        return self.names[0].lstrip("-").replace("-", "_")


def _same(flag: str) -> Callable[[object], list[str]]:
    return lambda v: [flag] if v is True else [flag, *v] if isinstance(v, list) else [flag, str(v)]


def _switch(*args: str) -> Callable[[object], list[str]]:
    return lambda v: list(args)


DTYPES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}
# SGLang's parser names for loraplex's parsers of the same format (others: serve names the choices).
# qwen25 reads <tool_call>{json}</tool_call>, the format loraplex's hermes parser reads
TOOL_PARSERS = {"llama3": "llama3_json", "llama4": "llama4_json", "qwen25": "hermes", "qwen": "hermes"}
REASONING_PARSERS = {"deepseek-r1": "deepseek_r1"}


def _lora_paths(values: list[str]) -> list[str]:
    out = []
    for item in values:
        if not item.lstrip().startswith("{") and "=" not in item:
            raise SGLangFlagError(f"--lora-paths {item}: give the adapter a name, NAME=PATH (SGLang names a bare "
                                  "path after itself; loraplex adapter names cannot hold a path)")
        out.append(_sglang_json_module(item) if item.lstrip().startswith("{") else item)
    return ["--lora-modules", *out]


def _sglang_json_module(item: str) -> str:
    """SGLang's JSON form ``{"lora_name", "lora_path", "pinned"}`` in vLLM's ``{"name", "path"}``."""
    import json

    try:
        fields = json.loads(item)
    except ValueError:
        raise SGLangFlagError(f"--lora-paths {item}: not a JSON object") from None
    if not isinstance(fields, dict) or set(fields) - {"lora_name", "lora_path", "pinned"}:
        raise SGLangFlagError(f"--lora-paths {item}: expected {{\"lora_name\", \"lora_path\", \"pinned\"?}}")
    return json.dumps({"name": fields.get("lora_name"), "path": fields.get("lora_path")})


def _int(flag: str, v: str) -> int:
    """A value this table reads itself (serve's argparse reads the ones passed on)."""
    try:
        return int(v)
    except ValueError:
        raise SGLangFlagError(f"{flag} {v}: must be an integer") from None


def _chunked_prefill(v) -> list[str]:
    size = _int("--chunked-prefill-size", v)
    return ["--no-enable-chunked-prefill"] if size == -1 else ["--max-num-batched-tokens", str(size)]


def _schedule_policy(v) -> list[str]:
    return ["--scheduling-policy", v] if v in ("fcfs", "priority") else []


def _nodes(v) -> list[str]:
    if _int("--nnodes", v) != 1:
        raise SGLangFlagError("--nnodes: loraplex runs a model on one device; run one replica per GPU on a "
                              "shared database and blob store instead")
    return []


TABLE: tuple[SGLangFlag, ...] = (
    # the model and the HTTP server
    SGLangFlag(("--model-path", "--model"), to=_same("--model")),
    SGLangFlag(("--tokenizer-path",), to=_same("--tokenizer")),
    SGLangFlag(("--served-model-name",), to=_same("--served-model-name")),
    SGLangFlag(("--host",), to=_same("--host")),
    SGLangFlag(("--port",), to=_same("--port")),
    SGLangFlag(("--api-key",), to=_same("--api-key")),
    SGLangFlag(("--dtype",), to=lambda v: ["--dtype", DTYPES.get(v, v)]),
    SGLangFlag(("--trust-remote-code",), nargs="0", to=_switch("--trust-remote-code")),
    SGLangFlag(("--revision",), to=_same("--revision")),
    SGLangFlag(("--download-dir",), to=_same("--download-dir")),
    SGLangFlag(("--device",), to=_same("--device")),
    SGLangFlag(("--random-seed",), to=_same("--seed")),
    SGLangFlag(("--log-level",), to=_same("--log-level")),
    SGLangFlag(("--chat-template",), to=_same("--chat-template")),
    SGLangFlag(("--reasoning-parser",), to=lambda v: ["--reasoning-parser", REASONING_PARSERS.get(v, v)]),
    SGLangFlag(("--tool-call-parser",), to=lambda v: ["--tool-call-parser", TOOL_PARSERS.get(v, v)]),
    SGLangFlag(("--quantization",), to=_same("--quantization")),
    SGLangFlag(("--kv-cache-dtype",), to=lambda v: ["--kv-cache-dtype", DTYPES.get(v, v)]),
    # memory and scheduling
    SGLangFlag(("--context-length",), to=_same("--max-model-len")),
    SGLangFlag(("--max-running-requests",), to=_same("--max-num-seqs")),
    SGLangFlag(("--chunked-prefill-size",), to=_chunked_prefill),
    SGLangFlag(("--disable-radix-cache",), nargs="0", to=_switch("--no-enable-prefix-caching")),
    SGLangFlag(("--disable-cuda-graph",), nargs="0", to=_switch("--no-cuda-graphs")),
    SGLangFlag(("--schedule-policy",), to=_schedule_policy,
               note="the order requests are scheduled in (fcfs and priority are loraplex's "
                    "--scheduling-policy; the others leave loraplex's fair per-tenant order)"),
    # the fraction of the GPU this process may hold for weights and KV cache, activation headroom
    # apart: loraplex's --gpu-memory-utilization (loraplex/engine/kv_budget.py)
    SGLangFlag(("--mem-fraction-static",), to=_same("--gpu-memory-utilization")),
    SGLangFlag(("--max-total-tokens",), refuse="size the KV cache with --kv-cache-bytes N or "
                                               "--kv-cache-memory-fraction F"),
    # LoRA
    SGLangFlag(("--enable-lora",), nargs="0", note="LoRA is always on in loraplex"),
    SGLangFlag(("--lora-paths",), nargs="+", to=_lora_paths),
    SGLangFlag(("--max-loras-per-batch",), to=_same("--max-loras")),
    SGLangFlag(("--max-lora-rank",), to=_same("--max-lora-rank")),
    SGLangFlag(("--max-loaded-loras",), to=_same("--max-cpu-loras")),
    SGLangFlag(("--lora-target-modules",), nargs="+",
               note="loraplex applies each adapter to the modules its own adapter_config.json targets"),
    SGLangFlag(("--lora-backend",), note="loraplex runs LoRA with its own Triton kernels"),
    SGLangFlag(("--max-lora-chunk-size",), note="the chunk size of SGLang's csgmv kernel; loraplex's kernels "
                                                 "tile by themselves"),
    SGLangFlag(("--lora-eviction-policy",), note="loraplex's adapter tiers evict the least recently used "
                                                  "adapter; which adapter leaves the GPU changes no output"),
    # parallelism: one device
    SGLangFlag(("--tp-size", "--tp", "--tensor-parallel-size"), to=_same("--tensor-parallel-size")),
    SGLangFlag(("--dp-size", "--dp", "--data-parallel-size"), to=_same("--data-parallel-size")),
    SGLangFlag(("--pp-size", "--pipeline-parallel-size"), to=_same("--pipeline-parallel-size")),
    SGLangFlag(("--nnodes",), to=_nodes),
    # no change to what is generated
    SGLangFlag(("--enable-metrics",), nargs="0", note="/metrics is always served"),
    SGLangFlag(("--log-requests",), nargs="0", note="loraplex writes one JSON access line per request"),
    SGLangFlag(("--skip-server-warmup",), nargs="0", note="loraplex opens its port once the model is loaded"),
    SGLangFlag(("--stream-interval",), note="loraplex streams every engine step"),
    SGLangFlag(("--attention-backend",), note="loraplex runs its own paged attention"),
    SGLangFlag(("--sampling-backend",), note="loraplex samples with its own sampler"),
    SGLangFlag(("--grammar-backend",), note="loraplex enforces json_schema, regex and ebnf with llguidance"),
    SGLangFlag(("--enable-torch-compile",), nargs="0", note="loraplex does not compile the model"),
    SGLangFlag(("--disable-overlap-schedule",), nargs="0", note="loraplex's scheduler does not overlap steps"),
    SGLangFlag(("--cuda-graph-max-bs",), note="loraplex's CUDA graphs (--cuda-graphs) pick their own sizes"),
    SGLangFlag(("--cuda-graph-bs",), nargs="+", note="loraplex's CUDA graphs (--cuda-graphs) pick their own sizes"),
    SGLangFlag(("--page-size",), note="loraplex's KV cache pages are --block-size tokens; the size changes no output"),
    SGLangFlag(("--schedule-conservativeness",), note="loraplex admits by its own KV-cache watermark"),
    SGLangFlag(("--watchdog-timeout",), note="loraplex has no scheduler watchdog"),
    # different behaviour: refused
    SGLangFlag(("--is-embedding",), nargs="0", refuse="loraplex serves generation models only"),
    SGLangFlag(("--allow-auto-truncate",), nargs="0",
               refuse="loraplex refuses prompts that do not fit; send truncate_prompt_tokens on the OpenAI routes"),
    SGLangFlag(("--speculative-algorithm",), refuse="use --speculative-config (vLLM's n-gram form)"),
    SGLangFlag(("--json-model-override-args",), refuse="loraplex reads the model's config.json as it is"),
    SGLangFlag(("--enable-p2p-check",), nargs="0", note="one device: nothing to check"),
)


def parser() -> argparse.ArgumentParser:
    """An argparse parser of the table's flags (values as strings)."""
    p = argparse.ArgumentParser(prog="loraplex sglang-serve", add_help=False, allow_abbrev=False)
    for row in TABLE:
        if row.nargs == "0":
            p.add_argument(*row.names, dest=row.dest, action="store_true", default=None)
        else:
            p.add_argument(*row.names, dest=row.dest, nargs=row.nargs, default=None)
    return p


def serve_flags_of_values() -> dict[str, str]:
    """The ``serve`` flag each table flag with one value becomes -> the table flag."""
    out = {}
    for row in TABLE:
        if row.to is None or row.nargs is not None:
            continue
        try:
            mapped = row.to("1")
        except (ValueError, TypeError):
            continue
        if mapped and mapped[0].startswith("--"):
            out.setdefault(mapped[0], row.names[0])
    return out


def known_flags() -> list[str]:
    return [name for row in TABLE for name in row.names]


@dataclass
class Translation:
    """A SGLang command line as ``loraplex serve`` arguments, and the no-op notes to log."""

    serve_argv: list[str]
    notes: list[str]
    # serve flag -> the SGLang flag given for it, as spelled (--tp or --tp-size ...): serve's
    # errors about that value name it so
    given_as: dict[str, str] = field(default_factory=dict)


def translate(argv: list[str]) -> Translation:
    """SGLang's ``argv`` (without ``python -m sglang.launch_server``) as ``serve`` arguments;
    what the table does not know is passed on. Raises ``SGLangFlagError`` for a refused flag."""
    args, rest = parser().parse_known_args(argv)
    serve, notes, given_as = [], [], {}
    for row in TABLE:
        value = getattr(args, row.dest)
        if value is None:
            continue
        shown = row.names[0] + ("" if value is True else " " + " ".join(value if isinstance(value, list) else [value]))
        if row.refuse:
            raise SGLangFlagError(f"{row.names[0]}: {row.refuse}")
        mapped = row.to(value) if row.to is not None else []
        serve += mapped
        if mapped and mapped[0].startswith("--") and row.nargs != "0":  # a value serve checks
            given_as[mapped[0]] = _spelling(row, argv)
        if row.note and not mapped:  # a no-op (--schedule-policy fcfs is taken, lpm is not)
            notes.append(f"{shown}: {row.note}")
    return Translation(serve + rest, notes, given_as)


def _spelling(row: SGLangFlag, argv: list[str]) -> str:
    """The name of ``row`` that ``argv`` used (the parser takes no abbreviations)."""
    return next((n for n in row.names if any(a == n or a.startswith(n + "=") for a in argv)), row.names[0])


def unknown_message(unknown: list[str], serve_options) -> str:
    """argparse's message for flags neither SGLang's table nor ``serve`` knows."""
    return unrecognized_message(unknown, [*known_flags(), *serve_options])
