"""What ``LLMEngine`` works out once, at start: its LoRA manager, the context its KV pool can
serve, the config it runs with (``finalised_config``), and the start-up log line (sizes and
limits an operator compares with vLLM's)."""

from __future__ import annotations

import logging
from typing import Any

from loraplex.config import EngineConfig, unchunked_token_budget
from loraplex.engine.kv_layout import KVLayout

logger = logging.getLogger("loraplex.engine")


def build_lora_manager(config: EngineConfig, runner) -> Any | None:
    """A ``LoRAManager`` for ``runner``'s model; None for a runner without LoRA support."""
    if not hasattr(runner, "lora_target_spec"):
        return None
    try:
        from loraplex.lora.manager import LoRAManager
    except ModuleNotFoundError as exc:
        if exc.name != "loraplex.lora.manager":
            raise
        return None
    return LoRAManager(spec=runner.lora_target_spec(), config=config, device=runner.device, dtype=runner.dtype)


def kv_layout_of(runner) -> KVLayout:
    """How ``runner``'s layers share pages; a runner without a layout (test fakes) is one
    group, windowed only when every layer is."""
    spec = getattr(runner, "spec", None)
    return getattr(runner, "kv_layout", None) or KVLayout.single(1, getattr(spec, "uniform_sliding_window", None))


def served_context(runner, layout: KVLayout, chunk: int | None) -> int:
    """``runner.max_model_len``, lowered (with a warning) to the longest context whose peak of
    pages fits the whole pool when one sequence could need more."""
    wanted, num_pages, block_size = runner.max_model_len, runner.num_blocks, runner.block_size
    if num_pages >= layout.peak_pages_per_sequence(wanted, block_size, chunk):
        return wanted
    fits = min(wanted, layout.longest_context_within(num_pages, wanted, block_size, chunk))
    logger.warning("KV cache holds only %d tokens: max_model_len lowered from %d to %d", fits, wanted, fits)
    return fits


def finalised_config(config: EngineConfig, max_model_len: int) -> EngineConfig:
    """``config`` as the engine runs it, once the context served is known: without chunked prefill
    the step budget follows that context (vLLM's rule, ``unchunked_token_budget``). The engine
    hands this one object to the runner, scheduler and LoRA manager, so all of them, the start-up
    line and ``stats()`` read the same ``max_num_batched_tokens``."""
    if config.enable_chunked_prefill:
        return config
    return config.replace(max_num_batched_tokens=unchunked_token_budget(config.max_num_batched_tokens, max_model_len))


def kv_bytes_per_token(runner) -> int | None:
    value = getattr(runner, "kv_bytes_per_token", None)
    if isinstance(value, int):
        return value
    spec = getattr(runner, "spec", None) or getattr(runner, "model_spec", None)
    dtype = getattr(runner, "kv_dtype", None) or getattr(runner, "dtype", None)
    if spec is not None and hasattr(spec, "kv_bytes_per_token") and hasattr(dtype, "itemsize"):
        return spec.kv_bytes_per_token(dtype.itemsize)
    return None


def max_concurrency(num_pages: int, layout: KVLayout, max_model_len: int, block_size: int,
                    chunk: int | None) -> float:
    """How many sequences of ``max_model_len`` tokens a pool of ``num_pages`` holds at once (vLLM
    logs the same figure). Not ``num_pages * block_size`` tokens: with layer groups a page holds
    one group's layers, and a long sequence takes pages in every group."""
    return num_pages / layout.peak_pages_per_sequence(max_model_len, block_size, chunk)


def log_start(engine, max_concurrency: float) -> None:
    """The start-up line with what the engine was built with (the one place the KV pool's
    ``max_concurrency`` is logged: ``max_concurrency`` above, at the context served)."""
    cfg, runner = engine.config, engine.runner
    host = getattr(engine.lora_manager, "host", None)
    logger.info(
        "loraplex engine: model=%s dtype=%s device=%s kv_bytes_per_token=%s num_blocks=%d "
        "block_size=%d max_concurrency=%.1f max_model_len=%d max_num_seqs=%d "
        "max_num_batched_tokens=%d chunked_prefill=%s prefix_caching=%s max_loras=%d "
        "max_lora_rank=%d max_cpu_lora_bytes=%s lora=%s cuda_graphs=%s overlap_outputs=%s "
        "overlap_lora_shrink=%s schedule_ahead=%s",
        engine.model_name, runner.dtype, runner.device, kv_bytes_per_token(runner), runner.num_blocks,
        runner.block_size, max_concurrency, engine.max_model_len,
        cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.enable_chunked_prefill,
        cfg.enable_prefix_caching, cfg.max_loras, cfg.max_lora_rank,
        getattr(host, "budget_bytes", cfg.max_cpu_lora_bytes),  # max_cpu_loras becomes bytes there
        "on" if engine.lora_manager is not None else "off",
        "on" if getattr(runner, "decode_graphs", None) is not None else "off",
        "on" if engine.overlap_outputs else "off",
        "on" if getattr(runner, "shrink_overlap", None) is not None else "off",
        "on" if engine.schedule_ahead else "off",
    )
    if cfg.speculative_config is not None:
        logger.info("speculative decoding: %s", cfg.speculative_config)
    if engine.sampling_defaults:  # as vLLM warns: outputs differ from the library defaults
        logger.warning("default sampling parameters of requests that leave them unset: %s; "
                       "--generation-config vllm turns this off", engine.sampling_defaults.describe())
