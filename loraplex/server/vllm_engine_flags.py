"""vLLM's engine flags that deployments pass and that are not loraplex settings: each taken when
its value means what loraplex does anyway (a no-op, logged once at start), refused otherwise with
what to use instead. None is ignored silently: a value that would change outputs or memory in
vLLM and has no loraplex equivalent stops the start.

The flags are vLLM's engine arguments (docs.vllm.ai "Engine Arguments": ``--kv-cache-dtype``,
``--swap-space``, ``--disable-sliding-window``, ``--max-parallel-loading-workers``, the revisions...)
that launch templates carry: the vLLM production-stack Helm chart
(helm/templates/deployment-vllm-multi.yaml) writes ``--no-enable-prefix-caching``,
``--kv-transfer-config`` for LMCache and ``extraArgs``; CAST AI's vLLM chart sets
``kvCacheDtype: auto`` and ``dtype: half``.
``--disable-sliding-window`` and the revisions depend on the model, so they are read once the
model is known (``check``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.config import DEFAULT_MODEL

# one device per process: what loraplex says instead of any form of parallelism
ONE_DEVICE = ("loraplex runs a model on one device (--device cuda:N); to use more GPUs run one replica "
              "per GPU on a shared database and blob store (LORAPLEX_DATABASE_URL, LORAPLEX_BLOB_URL)")
NO_DOWNLOADS = ("loraplex makes no downloads: fetch the model first (`huggingface-cli download MODEL "
                "--revision REV --local-dir DIR`) and serve DIR")


@dataclass(frozen=True)
class EngineFlag:
    """One vLLM flag: ``takes(value)`` says whether its value means what loraplex does (then
    ``note`` is logged at start), else ``refusal`` says why not and what to use instead."""

    flags: tuple[str, ...]
    options: dict
    takes: Callable[[Any], bool]
    note: str
    refusal: str = ""


def _equals(*values) -> Callable[[Any], bool]:
    return lambda value: value in values


def _always(_value) -> bool:
    return True


def _text_only(value: dict) -> bool:
    return all(count == 0 for count in value.values())


def mm_limits(text: str) -> dict[str, int]:
    """``--limit-mm-per-prompt``: vLLM's JSON object (``{"image": 0}``, a count or an object with
    ``count``) or its older ``image=0,video=0`` form -> modality -> count."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError:
        try:
            raw = {k.strip(): int(v) for k, v in (item.split("=", 1) for item in text.split(",") if item.strip())}
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object or modality=count,...") from None
    if not isinstance(raw, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object")
    limits = {}
    for modality, limit in raw.items():
        count = limit.get("count") if isinstance(limit, dict) else limit
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise argparse.ArgumentTypeError(f"{text!r}: {modality}: expected a count >= 0")
        limits[modality] = count
    return limits


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON {text!r}: {exc.msg}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object")
    return value


# dest (stored as vllm_<dest>) -> flag; dests match vLLM's
ENGINE_FLAGS: dict[str, EngineFlag] = {
    "kv_cache_dtype": EngineFlag(
        ("--kv-cache-dtype",), {}, _equals("auto"),
        "--kv-cache-dtype auto: the KV cache is kept in the model's dtype (--dtype), as in vLLM",
        "loraplex keeps the KV cache in the model's dtype (--dtype); there is no fp8 KV cache: to hold "
        "more tokens give --kv-cache-bytes N (or --kv-cache-memory-fraction) or a lower --max-model-len"),
    "tokenizer_mode": EngineFlag(
        ("--tokenizer-mode",), {}, _equals("auto", "hf"),
        "--tokenizer-mode: the model directory's Hugging Face tokenizer is used, as vLLM's auto/hf do",
        "loraplex loads the model directory's Hugging Face tokenizer (vLLM's auto); slow, mistral and "
        "custom tokenizers are not served"),
    "pipeline_parallel_size": EngineFlag(
        ("--pipeline-parallel-size", "-pp"), {"type": int}, _equals(1),
        "--pipeline-parallel-size 1: one device, as loraplex always runs", ONE_DEVICE),
    "data_parallel_size": EngineFlag(
        ("--data-parallel-size", "-dp"), {"type": int}, _equals(1),
        "--data-parallel-size 1: one engine, as loraplex always runs", ONE_DEVICE),
    "max_seq_len_to_capture": EngineFlag(
        ("--max-seq-len-to-capture",), {"type": int}, _always,
        "--max-seq-len-to-capture: a CUDA-graph setting, which changes speed, not outputs; loraplex's "
        "graphs follow --cuda-graphs / --enforce-eager"),
    "lora_dtype": EngineFlag(
        ("--lora-dtype",), {}, _equals("auto"),
        "--lora-dtype auto: adapters run in the model's dtype, as in vLLM",
        "loraplex runs adapters in the model's dtype: choose it with --dtype"),
    "max_parallel_loading_workers": EngineFlag(
        ("--max-parallel-loading-workers",), {"type": int}, _always,
        "--max-parallel-loading-workers: bounds host memory while loading tensor-parallel shards; loraplex "
        "loads one device's weights"),
    "swap_space": EngineFlag(
        ("--swap-space",), {"type": float}, _always,
        "--swap-space: no CPU swap space is reserved; preempted requests are recomputed, as in vLLM's V1 "
        "engine, which reads no swap space either"),
    "enable_log_requests": EngineFlag(
        ("--enable-log-requests",), {"action": argparse.BooleanOptionalAction}, _always,
        "--enable-log-requests: loraplex logs no prompts; each request has one JSON access line of counts"),
    "task": EngineFlag(
        ("--task",), {}, _equals("generate", "auto"),
        "--task generate: text generation, what loraplex serves",
        "loraplex serves text generation only (completions, chat, responses): no embedding, "
        "classification, scoring or reward models"),
    "runner": EngineFlag(
        ("--runner",), {}, _equals("generate", "auto"),
        "--runner generate: text generation, what loraplex serves",
        "loraplex serves text generation only (completions, chat, responses): no pooling models"),
    "async_scheduling": EngineFlag(
        ("--async-scheduling",), {"action": argparse.BooleanOptionalAction, "default": None}, _always,
        "--async-scheduling: overlapping scheduling with the model's step changes speed, not outputs"),
    "optimization_level": EngineFlag(
        ("-O", "--optimization-level"), {"choices": ["0", "1", "2", "3"]}, _always,
        "-O / --optimization-level: loraplex does not compile the model (torch.compile); CUDA graphs "
        "follow --cuda-graphs / --enforce-eager"),
    "compilation_config": EngineFlag(
        ("--compilation-config",), {"type": json_object}, _always,
        "--compilation-config: loraplex does not compile the model (torch.compile); CUDA graphs follow "
        "--cuda-graphs / --enforce-eager (cudagraph_mode NONE turns them off)"),
    "load_format": EngineFlag(
        ("--load-format",), {}, _equals("auto", "safetensors"),
        "--load-format: safetensors weights are read, as vLLM's auto does",
        "loraplex reads safetensors weights (or a .gguf file given as the model); other formats, and "
        "dummy (random) weights, are not served"),
    "limit_mm_per_prompt": EngineFlag(
        ("--limit-mm-per-prompt",), {"type": mm_limits}, _text_only,
        "--limit-mm-per-prompt of 0 per modality: text only, which is what loraplex serves",
        "loraplex serves text only: image, audio and video parts are a 400; give 0 per modality or "
        "leave the flag out"),
    "otlp_traces_endpoint": EngineFlag(
        ("--otlp-traces-endpoint",), {}, lambda value: False, "",
        "loraplex exports no OpenTelemetry traces: correlate requests by x-request-id (in each JSON "
        "access line) and watch the vllm:* metrics on /metrics"),
    "fully_sharded_loras": EngineFlag(
        ("--fully-sharded-loras",), {"action": argparse.BooleanOptionalAction}, _always,
        "--fully-sharded-loras: how LoRA is split across tensor-parallel devices; on one device, as "
        "loraplex runs, both layouts compute the same"),
    "disable_custom_all_reduce": EngineFlag(
        ("--disable-custom-all-reduce",), {"action": argparse.BooleanOptionalAction}, _always,
        "--disable-custom-all-reduce: one device has no all-reduce"),
    "distributed_executor_backend": EngineFlag(
        ("--distributed-executor-backend",), {}, _always,
        "--distributed-executor-backend: one device in the server's own process"),
    "disable_frontend_multiprocessing": EngineFlag(
        ("--disable-frontend-multiprocessing",), {"action": argparse.BooleanOptionalAction}, _always,
        "--disable-frontend-multiprocessing: loraplex runs the HTTP server and the engine in one process"),
    "cpu_offload_gb": EngineFlag(
        ("--cpu-offload-gb",), {"type": float}, _equals(0, 0.0),
        "--cpu-offload-gb 0: the weights stay on the device",
        "loraplex keeps every weight on the device: use a smaller model or --dtype, or a lower "
        "--kv-cache-bytes to leave room"),
    "kv_transfer_config": EngineFlag(
        ("--kv-transfer-config",), {"type": json_object}, lambda value: False, "",
        "loraplex keeps the KV cache in its own memory, with no KV connector (LMCache, NIXL, "
        "disaggregated prefill): leave the flag out; its prefix cache (--enable-prefix-caching) reuses "
        "prompt blocks within the process"),
    "guided_decoding_backend": EngineFlag(
        ("--guided-decoding-backend",), {}, _equals("auto", "guidance"),
        "--guided-decoding-backend: structured output is enforced by llguidance, vLLM's guidance backend",
        "loraplex enforces structured output with llguidance (vLLM's guidance backend), whose accepted "
        "schemas and whitespace differ from other backends': give guidance or auto, or leave it out"),
    "structured_outputs_config": EngineFlag(
        ("--structured-outputs-config",), {"type": json_object},
        lambda value: set(value) <= {"backend", "disable_fallback"} and value.get("backend", "auto") in ("auto", "guidance"),
        "--structured-outputs-config: structured output is enforced by llguidance, vLLM's guidance backend",
        "loraplex enforces structured output with llguidance (vLLM's guidance backend), whose accepted "
        'schemas and whitespace differ from other backends\'; only {"backend": "guidance"} (or auto) is '
        "taken: server-wide whitespace, additional-properties and reasoning switches are not (a request's "
        "structured_outputs.disable_any_whitespace is served)"),
    "enable_reasoning": EngineFlag(
        ("--enable-reasoning",), {"action": argparse.BooleanOptionalAction}, _always,
        "--enable-reasoning: older vLLM's switch for --reasoning-parser, which alone turns reasoning on"),
    "cuda_graph_sizes": EngineFlag(
        ("--cuda-graph-sizes",), {"type": int, "nargs": "+"}, _always,
        "--cuda-graph-sizes: which batch sizes get a CUDA graph changes speed, not outputs; loraplex "
        "captures its own batch buckets (--cuda-graphs / --enforce-eager)"),
    "api_server_count": EngineFlag(
        ("--api-server-count",), {"type": int}, _equals(1),
        "--api-server-count 1: one HTTP server process, as loraplex runs",
        "loraplex runs one HTTP server process per replica (prompts are tokenized off its event loop): "
        "to serve more, run more replicas behind a balancer on a shared database and blob store"),
    "headless": EngineFlag(
        ("--headless",), {"action": argparse.BooleanOptionalAction}, lambda value: value is False, "",
        "loraplex always serves its own HTTP API; engines without one (vLLM's data-parallel ranks) are "
        f"not served: {ONE_DEVICE}"),
    "enable_sleep_mode": EngineFlag(
        ("--enable-sleep-mode",), {"action": argparse.BooleanOptionalAction}, lambda value: value is False, "",
        "loraplex has no /sleep and /wake_up endpoints: to give the GPU back stop the replica (SIGTERM "
        "drains it); adapters stay in the registry and load again on demand"),
    "hf_overrides": EngineFlag(
        ("--hf-overrides",), {"type": json_object}, lambda value: not value, "",
        "loraplex reads the model's config.json as saved: edit a copy of the model directory"),
}

# flags whose meaning depends on the model, checked once it is known (``check``)
MODEL_FLAGS = {
    "tokenizer": (("--tokenizer",), {}),
    "revision": (("--revision",), {}),
    "tokenizer_revision": (("--tokenizer-revision",), {}),
    "code_revision": (("--code-revision",), {}),
    "download_dir": (("--download-dir",), {}),
    "disable_sliding_window": (("--disable-sliding-window",), {"action": argparse.BooleanOptionalAction}),
}


def add_engine_flags(group) -> None:
    """The flags above, into ``group`` (the "vLLM flags" argument group)."""
    def named(dest: str, options: dict) -> dict:  # --kv-cache-dtype KV_CACHE_DTYPE in --help
        return {"default": None, **({} if "action" in options else {"metavar": dest.upper()}), **options}

    for dest, flag in ENGINE_FLAGS.items():
        kind = "taken" if flag.note else "refused"
        group.add_argument(*flag.flags, dest=f"vllm_{dest}", **named(dest, flag.options),
                           help=f"{kind} as in vLLM where the value means what loraplex does (see README)")
    for dest, (flags, options) in MODEL_FLAGS.items():
        group.add_argument(*flags, dest=f"vllm_{dest}", **named(dest, options),
                           help="taken when it means what loraplex does with this model (see README)")


def given(args: argparse.Namespace, dest: str):
    return getattr(args, f"vllm_{dest}", None)


def refusals(args: argparse.Namespace) -> list[str]:
    """``--flag VALUE: why, and what instead`` for each flag whose value loraplex cannot honour."""
    out = []
    for dest, flag in ENGINE_FLAGS.items():
        value = given(args, dest)
        if value is not None and not flag.takes(value):
            shown = "" if value is True else f" {json.dumps(value) if isinstance(value, dict) else value}"
            out.append(f"{flag.flags[0]}{shown}: {flag.refusal}")
    return out


def apply(args: argparse.Namespace, overrides: dict) -> dict:
    """``overrides`` with what a taken flag asks of loraplex's settings: a compilation config
    with ``cudagraph_mode`` ``NONE`` turns CUDA graphs off (vLLM's eager mode)."""
    config = given(args, "compilation_config") or {}
    if str(config.get("cudagraph_mode", "")).upper() == "NONE":
        if overrides.get("cuda_graphs"):
            raise ValueError('--compilation-config {"cudagraph_mode": "NONE"} turns CUDA graphs off and '
                             "--cuda-graphs on: give one")
        return {**overrides, "cuda_graphs": False}
    return overrides


def notes(args: argparse.Namespace) -> list[str]:
    """What each taken flag means in loraplex, for the start-up log (info, once)."""
    out = [flag.note for dest, flag in ENGINE_FLAGS.items()
           if given(args, dest) is not None and given(args, dest) is not False and flag.takes(given(args, dest))]
    for dest in MODEL_FLAGS:
        if given(args, dest):
            out.append(MODEL_NOTES[dest])
    return out


MODEL_NOTES = {
    "tokenizer": "--tokenizer: the model directory's own tokenizer, as given",
    "revision": "--revision: the model is a local directory, which has no revisions (as in transformers)",
    "tokenizer_revision": "--tokenizer-revision: the model is a local directory, which has no revisions",
    "code_revision": "--code-revision: the model is a local directory, and loraplex runs no code from it",
    "download_dir": "--download-dir: the model is local, nothing is downloaded",
    "disable_sliding_window": "--disable-sliding-window: the context is within the model's sliding window "
                              "(or it has none), so nothing changes",
}


def is_local(model: str) -> bool:
    return model == DEFAULT_MODEL or Path(model).expanduser().exists()


def model_refusals(args: argparse.Namespace, model: str, max_model_len: int | None,
                   reasoning_parser: str | None = None) -> list[str]:
    """The refusals of ``MODEL_FLAGS`` for the model being served (``model`` as in Settings), and
    older vLLM's ``--enable-reasoning`` without a parser (its start-up error)."""
    out = []
    if given(args, "enable_reasoning") and reasoning_parser is None:
        out.append("--enable-reasoning: requires --reasoning-parser, as in vLLM")
    tokenizer = given(args, "tokenizer")
    if tokenizer is not None and not _same_path(tokenizer, model):
        out.append(f"--tokenizer {tokenizer}: loraplex reads the tokenizer from the model ({model}); copy "
                   "the tokenizer's files into the model directory")
    for dest in ("revision", "tokenizer_revision", "code_revision", "download_dir"):
        value = given(args, dest)
        if value is not None and not is_local(model):
            out.append(f"{MODEL_FLAGS[dest][0][0]} {value}: {NO_DOWNLOADS}")
    if given(args, "disable_sliding_window"):
        why = _sliding_window(model, max_model_len)
        if why is not None:
            out.append(f"--disable-sliding-window: {why}")
    return out


def _same_path(a: str, b: str) -> bool:
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def _sliding_window(model: str, max_model_len: int | None) -> str | None:
    """Why ``--disable-sliding-window`` cannot be taken for ``model``, or None when it changes
    nothing: the model attends without a window, or ``max_model_len`` is within its window. vLLM
    disables the window by capping the context at it, and within the window windowed and full
    attention are the same computation."""
    from loraplex.model.config import ModelSpec

    directory = Path(model).expanduser()
    if model == DEFAULT_MODEL:
        return None  # SmolLM2: a Llama, no window
    if not (directory / "config.json").is_file():
        return ("loraplex reads the model's window from a model directory's config.json; for a .gguf give "
                "--max-model-len W (its sliding window) instead, the same outputs as vLLM's")
    spec = ModelSpec.from_dir(directory)
    # every layer's window (Gemma 2/3 and Qwen with use_sliding_window mix windowed and global
    # layers): within the smallest, windowed and full attention read the same keys
    window = min((w for w in spec.layer_windows if w is not None), default=None)
    if window is None or (max_model_len is not None and max_model_len <= window):
        return None
    return (f"loraplex keeps the model's sliding window ({window} tokens); vLLM's flag caps the context at "
            f"the window, so give --max-model-len {window} for the same outputs")
