"""vLLM's flags that are not loraplex settings, on ``loraplex serve`` and ``run-batch``: each taken
when its value means what loraplex does anyway (a no-op, logged once at start), refused otherwise
with what to use instead. None is ignored silently: a value that would change outputs or memory in
vLLM and has no loraplex equivalent stops the start. The flags and their meaning are one table,
loraplex/server/vllm_flag_table.py; this module adds them to a parser and reads them back.

Some taken flags set a loraplex setting: ``--kv-cache-memory-bytes`` is ``--kv-cache-bytes``,
``-O0`` (vLLM's "no compilation, no CUDA graphs") and a compilation config vLLM runs without CUDA
graphs (``cudagraph_mode`` ``NONE``, or ``level`` / ``mode`` 0 without a full-graph mode:
``compilation_without_graphs``) turn CUDA graphs off as ``--enforce-eager`` does (``apply``).
``--tokenizer``, ``--hf-config-path``, ``--disable-sliding-window`` and the revisions depend on the model, so they
are read once the model is known (``model_refusals``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from loraplex.config import DEFAULT_MODEL
from loraplex.server.vllm_flag_kinds import NO_DOWNLOADS, ONE_DEVICE, EngineFlag, json_object, mm_limits
from loraplex.server.vllm_flag_table import BATCH_ONLY, ENGINE_FLAGS, SERVE_ONLY

__all__ = ["ENGINE_FLAGS", "MODEL_FLAGS", "ONE_DEVICE", "EngineFlag", "json_object", "mm_limits"]


# flags whose meaning depends on the model, checked once it is known (``check``)
MODEL_FLAGS = {
    "tokenizer": (("--tokenizer",), {}),
    "hf_config_path": (("--hf-config-path",), {}),
    "revision": (("--revision",), {}),
    "tokenizer_revision": (("--tokenizer-revision",), {}),
    "code_revision": (("--code-revision",), {}),
    "download_dir": (("--download-dir",), {}),
    "disable_sliding_window": (("--disable-sliding-window",), {"action": argparse.BooleanOptionalAction}),
}


def add_engine_flags(group, command: str = "serve") -> None:
    """The table's flags, and ``MODEL_FLAGS``, into ``group`` (the "vLLM flags" argument group of
    ``loraplex command``: vLLM's run_batch flags only for ``run-batch``, its HTTP front end's only
    for ``serve``)."""
    def named(dest: str, options: dict) -> dict:  # --kv-cache-dtype KV_CACHE_DTYPE in --help
        return {"default": None, **({} if "action" in options else {"metavar": dest.upper()}), **options}

    for dest, flag in ENGINE_FLAGS.items():
        if dest in (SERVE_ONLY if command == "run-batch" else BATCH_ONLY):
            continue
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
    """``overrides`` with what a taken flag asks of loraplex's settings: ``-O0`` or a compilation
    config vLLM runs without CUDA graphs (``compilation_without_graphs``) turns them off, and
    ``--kv-cache-memory-bytes`` is ``--kv-cache-bytes``. Raises ``ValueError`` for a loraplex flag
    that says otherwise."""
    out = dict(overrides)
    config = given(args, "compilation_config") or {}
    eager = [f"-O {given(args, 'optimization_level')}"] if given(args, "optimization_level") == "0" else []
    if compilation_without_graphs(config):
        eager.append(f"--compilation-config {json.dumps(config)}")
    if eager:
        if out.get("cuda_graphs"):
            raise ValueError(f"{eager[0]} turns CUDA graphs off and --cuda-graphs on: give one")
        out["cuda_graphs"] = False  # also over LORAPLEX_CUDA_GRAPHS=true
    size = given(args, "kv_cache_memory_bytes")
    if size is not None:
        if out.get("kv_cache_bytes", size) != size:
            raise ValueError(f"--kv-cache-memory-bytes {size} and --kv-cache-bytes {out['kv_cache_bytes']} "
                             "size the same KV cache: give one")
        out["kv_cache_bytes"] = size
    return out


# vLLM's CompilationMode (older CompilationLevel) names -> number; 3 is its own compiler's
COMPILATION_MODES = {"NONE": 0, "NO_COMPILATION": 0, "STOCK_TORCH_COMPILE": 1, "DYNAMO_AS_IS": 1,
                     "DYNAMO_TRACE_ONCE": 2, "DYNAMO_ONCE": 2, "VLLM_COMPILE": 3, "PIECEWISE": 3}
# CUDA-graph modes that capture the whole forward, which vLLM runs without its compiler too
FULL_GRAPH_MODES = ("FULL", "FULL_DECODE_ONLY")


def _compilation_mode(config: dict) -> int | None:
    mode = config.get("mode", config.get("level"))
    if isinstance(mode, bool):
        return None
    if isinstance(mode, int):
        return mode
    if isinstance(mode, str):
        text = mode.strip().upper()
        return int(text) if text.isdigit() else COMPILATION_MODES.get(text)
    return None


def compilation_without_graphs(config: dict) -> bool:
    """Whether vLLM runs a ``--compilation-config`` without CUDA graphs: ``cudagraph_mode``
    ``NONE`` (or the older ``use_cudagraph: false``), or a mode (``level``) other than its own
    compiler (3) without a full-graph ``cudagraph_mode``: vLLM's default graph mode is then NONE,
    and a piecewise one is overridden to NONE, since piecewise graphs need its compiler
    (vllm/config/vllm.py; ``-cc.mode=0`` is its "no compile or cudagraph")."""
    graph_mode = str(config.get("cudagraph_mode", "")).strip().upper()
    if graph_mode == "NONE" or config.get("use_cudagraph") is False:
        return True
    mode = _compilation_mode(config)
    return mode is not None and mode != 3 and graph_mode not in FULL_GRAPH_MODES


def uvicorn_options(args: argparse.Namespace) -> dict:
    """``uvicorn.Config`` keywords the taken front-end flags ask for. ``--h11-max-incomplete-event-size``
    also picks uvicorn's h11 protocol: uvicorn otherwise takes httptools (installed with loraplex),
    which ignores the limit, so the flag would bound nothing."""
    size = given(args, "h11_max_incomplete_event_size")
    return {} if size is None else {"h11_max_incomplete_event_size": size, "http": "h11"}


def notes(args: argparse.Namespace) -> list[str]:
    """What each taken flag means in loraplex, for the start-up log (info, once). A refused flag
    given as what loraplex does anyway (``--no-X``, an empty JSON object) has nothing to say."""
    out = [flag.note for dest, flag in ENGINE_FLAGS.items()
           if flag.note and given(args, dest) is not None and given(args, dest) is not False
           and flag.takes(given(args, dest))]
    for dest in MODEL_FLAGS:
        if given(args, dest):
            out.append(MODEL_NOTES[dest])
    return out


MODEL_NOTES = {
    "tokenizer": "--tokenizer: the model directory's own tokenizer, as given",
    "hf_config_path": "--hf-config-path: the model directory's own config.json, as given",
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
                   reasoning_parser: str | None = None, kv_cache_dtype: str = "auto") -> list[str]:
    """The refusals of ``MODEL_FLAGS`` for the model being served (``model`` as in Settings),
    older vLLM's ``--enable-reasoning`` without a parser (its start-up error), and
    ``--calculate-kv-scales`` with an fp8 KV cache."""
    out = []
    if given(args, "enable_reasoning") and reasoning_parser is None:
        out.append("--enable-reasoning: requires --reasoning-parser, as in vLLM")
    if given(args, "calculate_kv_scales") and kv_cache_dtype.startswith("fp8"):  # vLLM scales only an fp8 cache
        # vLLM computes the fp8 cache's k/v scales from the first forward pass; loraplex writes
        # it with the checkpoint's calibrated scales or 1.0, so the cached values (and outputs) would differ
        out.append(f"--calculate-kv-scales: loraplex writes a --kv-cache-dtype {kv_cache_dtype} cache with "
                   "the checkpoint's calibrated k_scale / v_scale (1.0 without), not scales computed from the "
                   "first batch as vLLM does: leave the flag out, or keep the cache in the model's dtype "
                   "(--kv-cache-dtype auto)")
    tokenizer = given(args, "tokenizer")
    if tokenizer is not None and not _same_path(tokenizer, model):
        out.append(f"--tokenizer {tokenizer}: loraplex reads the tokenizer from the model ({model}); copy "
                   "the tokenizer's files into the model directory")
    hf_config = given(args, "hf_config_path")
    if hf_config is not None and not _same_path(hf_config, model):
        out.append(f"--hf-config-path {hf_config}: loraplex reads config.json from the model ({model}); copy "
                   "the config into (a copy of) the model directory")
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
