"""loraplex's table of vLLM's ``serve`` flags that are not loraplex settings: every such flag of
``vllm serve`` (and ``run-batch``, which takes the same engine flags) is a row, taken where its
value means what loraplex does (a note logged once at start says why nothing changes) and refused
otherwise with loraplex's way. The other vLLM flags are loraplex settings or flags under the same
name and meaning (``--max-loras``, ``--dtype``, ``--seed``, ``--allowed-origins``...; see
loraplex/server/cli.py, vllm_flags.py, http_options.py).

The flags are vLLM's ``EngineArgs.add_cli_args`` (vllm/engine/arg_utils.py), ``FrontendArgs`` and
``make_arg_parser`` (vllm/entrypoints/openai/cli_args.py), as the "Engine Arguments" and "vllm
serve" CLI pages document them, plus older names launch templates still carry
(``--guided-decoding-backend``, ``--max-seq-len-to-capture``, ``--use-v2-block-manager``...). A
flag whose value changes outputs in vLLM is taken only with that meaning, or refused: never
ignored. Model-dependent flags (``--tokenizer``, the revisions, ``--disable-sliding-window``,
``--hf-config-path``) are loraplex/server/vllm_engine_flags.py's ``MODEL_FLAGS``.
"""

from __future__ import annotations

import argparse

from loraplex.server.vllm_flag_kinds import (
    ACROSS_DEVICES,
    BOOL,
    FLOAT,
    INT,
    JSON,
    LIST,
    NO_GENERATION_ONLY,
    NO_PLUGINS,
    NO_TRACING,
    ONE_DEVICE,
    STR,
    TEXT_ONLY,
    EngineFlag,
    _always,
    _equals,
    _text_only,
    compilation_config,
    human_readable_int,
    json_object,
    mm_limits,
    refused,
    taken,
    taken_if,
)

# flags of vLLM's run_batch alone (`serve` has its own --port and --max-log-len)
BATCH_ONLY = frozenset({"output_tmp_dir", "enable_metrics", "url", "port", "max_log_len"})
# vLLM's HTTP front-end flags, which its run_batch does not take either
SERVE_ONLY = frozenset({
    "uds", "enable_ssl_refresh", "middleware", "exclude_tools_when_tool_choice_none", "tool_parser_plugin",
    "tool_server", "log_config_file", "enable_server_load_tracking", "enable_tokenizer_info_endpoint",
    "enable_log_outputs", "h11_max_incomplete_event_size", "h11_max_header_count", "log_error_stack", "tokens_only",
    "default_chat_template_kwargs",
})

# dest (stored as vllm_<dest>) -> flag; dests match vLLM's
ENGINE_FLAGS: dict[str, EngineFlag] = {
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
        "--lora-dtype auto: adapters run in the model's dtype, as in vLLM (on CPU in float32, the more "
        "precise, since CPU bfloat16 matmuls are slow)",
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
        "--async-scheduling: taken as --overlap-outputs --schedule-ahead (a step's outputs are made, and the "
        "next plain decode step is scheduled and launched, while the device runs this one: speed, not outputs)"),
    "optimization_level": EngineFlag(
        ("-O", "--optimization-level"), {"choices": ["0", "1", "2", "3"]}, _always,
        "-O / --optimization-level: loraplex does not compile the model (torch.compile); -O0 turns CUDA "
        "graphs off (vLLM's level without them), other levels leave them to --cuda-graphs / --enforce-eager"),
    "compilation_config": EngineFlag(
        ("--compilation-config", "-cc"), {"type": compilation_config}, _always,
        "--compilation-config: loraplex does not compile the model (torch.compile); CUDA graphs follow "
        "--cuda-graphs / --enforce-eager, and are off where vLLM would run without them (cudagraph_mode "
        "NONE, or level / mode 0-2 without a FULL cudagraph_mode)"),
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
        ("--api-server-count", "-asc"), {"type": int}, _equals(1),
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
    # --- the rest of `vllm serve`'s flags
    # the OpenAI-compatible front end (FrontendArgs)
    "uds": refused("--uds", STR, "loraplex listens on TCP (--host, --port): put a local proxy in front "
                   "for a unix socket"),
    "enable_ssl_refresh": refused("--enable-ssl-refresh", BOOL, "loraplex loads the TLS files at start: "
                                  "restart the replica (SIGTERM drains it) to load renewed certificates"),
    "middleware": refused("--middleware", {"action": "append"}, f"{NO_PLUGINS}; put a proxy in front"),
    "exclude_tools_when_tool_choice_none": refused(
        "--exclude-tools-when-tool-choice-none", BOOL,
        'loraplex renders a request\'s tools into the prompt whatever tool_choice says (vLLM\'s default): '
        'leave "tools" out of requests with tool_choice "none" instead'),
    "tool_parser_plugin": taken_if(
        "--tool-parser-plugin", STR, _equals(""), "no plugin", "loraplex runs its own tool-call parsers "
        "(--tool-call-parser hermes, llama3_json, ...), no plugins"),
    "tool_server": refused("--tool-server", STR, "loraplex runs no built-in tools or MCP tool servers: "
                           "function tools come back to the client, as in OpenAI's function calling"),
    "log_config_file": refused("--log-config-file", STR, "loraplex configures its own logging: --log-level "
                               "and --uvicorn-log-level; access lines are JSON on stdout"),
    "enable_server_load_tracking": refused(
        "--enable-server-load-tracking", BOOL, "loraplex has no /load endpoint: watch "
        "vllm:num_requests_running and vllm:num_requests_waiting on /metrics"),
    "enable_force_include_usage": refused(
        "--enable-force-include-usage", BOOL, "loraplex streams usage when a request asks "
        "(stream_options.include_usage), as vLLM's default; it is always in answers that are not streamed"),
    "enable_tokenizer_info_endpoint": refused(
        "--enable-tokenizer-info-endpoint", BOOL, "loraplex has no /get_tokenizer_info endpoint; "
        "/tokenize and /detokenize are served"),
    "enable_log_outputs": taken("--enable-log-outputs", BOOL, "loraplex logs no generations (one JSON "
                                "access line of counts per request)"),
    "h11_max_incomplete_event_size": taken(
        "--h11-max-incomplete-event-size", INT, "the same limit, passed to uvicorn's h11 parser, which serves "
        "HTTP when it is given (httptools otherwise, whose head limit is 4 MiB, vLLM's default)"),
    "h11_max_header_count": refused(
        "--h11-max-header-count", INT, "loraplex's HTTP server (uvicorn) counts no headers: a "
        "request's head is bounded in bytes (4 MiB; --h11-max-incomplete-event-size on h11), its body by --max-body-bytes"),
    "log_error_stack": taken("--log-error-stack", BOOL, "error answers are unchanged; loraplex logs every "
                             "internal error (500) with its traceback"),
    "tokens_only": refused("--tokens-only", BOOL, "loraplex serves the whole OpenAI-compatible API"),
    "default_chat_template_kwargs": refused(
        "--default-chat-template-kwargs", JSON, "server-wide chat template variables are not taken: send "
        "them per request as chat_template_kwargs (served)"),
    # ModelConfig
    "convert": taken_if("--convert", STR, _equals("auto", "none"), "the model generates text, as loraplex "
                        "serves it", NO_GENERATION_ONLY),
    "allowed_local_media_path": taken("--allowed-local-media-path", STR, TEXT_ONLY),
    "allowed_media_domains": taken("--allowed-media-domains", LIST, TEXT_ONLY),
    "rope_scaling": refused("--rope-scaling", JSON, "loraplex applies the rope scaling of the model's "
                            "config.json: edit a copy of the model directory"),
    "rope_theta": refused("--rope-theta", FLOAT, "loraplex applies the rope_theta of the model's config.json: "
                          "edit a copy of the model directory"),
    "logprobs_mode": taken_if(
        "--logprobs-mode", STR, _equals("raw_logprobs"), "log-probabilities of the model's own distribution, "
        "before sampling parameters change it, as vLLM's default", "loraplex returns the model's own "
        "log-probabilities (vLLM's raw_logprobs): processed and logits modes are not served"),
    "disable_cascade_attn": taken("--disable-cascade-attn", BOOL, "cascade attention is a speed-up for "
                                  "shared prefixes; loraplex's attention computes the same result"),
    "skip_tokenizer_init": refused("--skip-tokenizer-init", BOOL, "loraplex tokenizes prompts and "
                                   "detokenizes outputs; completions also take a prompt of token ids"),
    "enable_prompt_embeds": refused("--enable-prompt-embeds", BOOL, "loraplex takes prompts as text or "
                                    "token ids, not embeddings"),
    "config_format": taken_if("--config-format", STR, _equals("auto", "hf"), "the model's config.json "
                              "(Hugging Face format) is read", "loraplex reads a Hugging Face config.json; "
                              "Mistral-format (params.json) directories are not served"),
    "hf_token": taken("--hf-token", {"nargs": "?", "const": True}, "loraplex makes no downloads, so no "
                      "token is sent (a model that is not local fails to load)"),
    "pooler_config": refused("--pooler-config", JSON, NO_GENERATION_ONLY),
    "override_pooler_config": refused("--override-pooler-config", JSON, NO_GENERATION_ONLY),
    "logits_processor_pattern": refused("--logits-processor-pattern", STR, "requests cannot name logits "
                                        f"processors in loraplex: {NO_PLUGINS}"),
    "logits_processors": refused("--logits-processors", LIST, NO_PLUGINS),
    "io_processor_plugin": refused("--io-processor-plugin", STR, NO_PLUGINS),
    "model_impl": taken_if("--model-impl", STR, _equals("auto", "vllm"), "loraplex runs its own "
                           "implementation of each architecture", "loraplex runs its own implementation of "
                           "each architecture it lists; transformers' and other backends are not served"),
    "override_attention_dtype": refused("--override-attention-dtype", STR, "loraplex computes attention "
                                        "in the model's dtype: choose it with --dtype"),
    # LoadConfig
    "safetensors_load_strategy": taken("--safetensors-load-strategy", STR, "how the files are read; the "
                                       "same weights load"),
    "model_loader_extra_config": refused("--model-loader-extra-config", JSON, "loraplex's loader takes no "
                                         "extra options"),
    "ignore_patterns": taken_if(
        "--ignore-patterns", LIST, lambda value: value in (["original/**/*"], ["original/**"]),
        "vLLM's default", "loraplex chooses the weight files itself: serve a directory that holds only "
        "the model's files"),
    "use_tqdm_on_load": taken("--use-tqdm-on-load", BOOL, "a progress bar while loading"),
    "pt_load_map_location": taken("--pt-load-map-location", STR, "where .pt weights are mapped; loraplex "
                                  "reads safetensors"),
    # StructuredOutputsConfig (vLLM's older names)
    "guided_decoding_disable_fallback": taken(
        "--guided-decoding-disable-fallback", BOOL, "one backend (llguidance): nothing to fall back to; an "
        "unsupported schema is a 400"),
    "guided_decoding_disable_any_whitespace": refused(
        "--guided-decoding-disable-any-whitespace", BOOL, "no server-wide whitespace switch: a request's "
        "structured_outputs.disable_any_whitespace is served"),
    "guided_decoding_disable_additional_properties": refused(
        "--guided-decoding-disable-additional-properties", BOOL, "loraplex enforces a JSON schema's "
        "additionalProperties as the schema says"),
    # ParallelConfig
    "decode_context_parallel_size": taken_if("--decode-context-parallel-size -dcp", INT, _equals(1),
                                             "one device, as loraplex runs", ONE_DEVICE),
    "data_parallel_rank": taken_if("--data-parallel-rank -dpn", INT, _equals(0), "the only rank", ONE_DEVICE),
    "data_parallel_start_rank": taken_if("--data-parallel-start-rank -dpr", INT, _equals(0), "the only rank",
                                         ONE_DEVICE),
    "data_parallel_size_local": taken_if("--data-parallel-size-local -dpl", INT, _equals(1), "one engine",
                                         ONE_DEVICE),
    "data_parallel_address": refused("--data-parallel-address -dpa", STR, ONE_DEVICE),
    "data_parallel_rpc_port": refused("--data-parallel-rpc-port -dpp", INT, ONE_DEVICE),
    "data_parallel_backend": taken("--data-parallel-backend -dpb", STR, ACROSS_DEVICES),
    "data_parallel_hybrid_lb": refused("--data-parallel-hybrid-lb", BOOL, ONE_DEVICE),
    "data_parallel_external_lb": refused("--data-parallel-external-lb", BOOL, ONE_DEVICE),
    **{dest: taken(flags, options, ACROSS_DEVICES) for dest, flags, options in (
        ("enable_expert_parallel", "--enable-expert-parallel", BOOL),
        ("all2all_backend", "--all2all-backend", STR),
        ("enable_dbo", "--enable-dbo", BOOL),
        ("dbo_decode_token_threshold", "--dbo-decode-token-threshold", INT),
        ("dbo_prefill_token_threshold", "--dbo-prefill-token-threshold", INT),
        ("disable_nccl_for_dp_synchronization", "--disable-nccl-for-dp-synchronization", BOOL),
        ("enable_eplb", "--enable-eplb", BOOL),
        ("eplb_config", "--eplb-config", JSON),
        ("expert_placement_strategy", "--expert-placement-strategy", STR),
        ("num_redundant_experts", "--num-redundant-experts", INT),
        ("eplb_window_size", "--eplb-window-size", INT),
        ("eplb_step_interval", "--eplb-step-interval", INT),
        ("eplb_log_balancedness", "--eplb-log-balancedness", BOOL),
        ("ray_workers_use_nsight", "--ray-workers-use-nsight", BOOL),
    )},
    "worker_cls": taken_if("--worker-cls", STR, _equals("auto"), "the engine runs in the server's process",
                           NO_PLUGINS),
    "worker_extension_cls": taken_if("--worker-extension-cls", STR, _equals(""), "no extension", NO_PLUGINS),
    # CacheConfig
    "kv_cache_memory_bytes": EngineFlag(
        ("--kv-cache-memory-bytes",), {"type": human_readable_int}, _always,
        "--kv-cache-memory-bytes: the KV cache's size in bytes, taken as --kv-cache-bytes"),
    "num_gpu_blocks_override": refused("--num-gpu-blocks-override", INT, "loraplex sizes the KV cache in "
                                       "bytes: --kv-cache-bytes N (blocks of --block-size tokens)"),
    "prefix_caching_hash_algo": taken("--prefix-caching-hash-algo", STR, "loraplex names prefix blocks by "
                                      "sha256 (of the adapter, cache salt and tokens), whatever the value"),
    # with an fp8 --kv-cache-dtype it is refused once the settings are known (vllm_engine_flags)
    "calculate_kv_scales": taken("--calculate-kv-scales", BOOL, "scales of an fp8 KV cache; with "
                                 "--kv-cache-dtype auto the cache is in the model's dtype and has none"),
    "kv_sharing_fast_prefill": refused("--kv-sharing-fast-prefill", BOOL, "it skips prefill work of "
                                       "KV-sharing layers, which changes outputs; loraplex computes every layer"),
    "mamba_cache_dtype": taken_if("--mamba-cache-dtype", STR, _equals("auto"), "the model's dtype",
                                  "loraplex keeps every cache in the model's dtype: choose it with --dtype"),
    "mamba_ssm_cache_dtype": taken_if("--mamba-ssm-cache-dtype", STR, _equals("auto"), "the model's dtype",
                                      "loraplex keeps every cache in the model's dtype: choose it with --dtype"),
    "mamba_block_size": refused("--mamba-block-size", INT, "loraplex lays out its caches itself (--block-size "
                                "for the KV cache)"),
    "kv_offloading_size": refused("--kv-offloading-size", FLOAT, "loraplex keeps the KV cache on the device; "
                                  "no CPU offloading (preempted requests are recomputed)"),
    "kv_offloading_backend": refused("--kv-offloading-backend", STR, "loraplex keeps the KV cache on the "
                                     "device; no CPU offloading"),
    # MultiModalConfig: nothing to act on in a text-only server
    "enable_mm_embeds": refused("--enable-mm-embeds", BOOL, TEXT_ONLY),
    **{dest: taken(flags, options, TEXT_ONLY) for dest, flags, options in (
        ("media_io_kwargs", "--media-io-kwargs", JSON),
        ("mm_processor_kwargs", "--mm-processor-kwargs", JSON),
        ("mm_processor_cache_gb", "--mm-processor-cache-gb", FLOAT),
        ("disable_mm_preprocessor_cache", "--disable-mm-preprocessor-cache", BOOL),
        ("mm_processor_cache_type", "--mm-processor-cache-type", STR),
        ("mm_shm_cache_max_object_size_mb", "--mm-shm-cache-max-object-size-mb", INT),
        ("mm_encoder_tp_mode", "--mm-encoder-tp-mode", STR),
        ("mm_encoder_attn_backend", "--mm-encoder-attn-backend", STR),
        ("interleave_mm_strings", "--interleave-mm-strings", BOOL),
        ("skip_mm_profiling", "--skip-mm-profiling", BOOL),
        ("video_pruning_rate", "--video-pruning-rate", FLOAT),
        ("enable_multimodal_encoder_data_parallel", "--enable-multimodal-encoder-data-parallel", BOOL),
        ("default_mm_loras", "--default-mm-loras", JSON),
        ("disable_chunked_mm_input", "--disable-chunked-mm-input", BOOL),
    )},
    # LoRAConfig
    "lora_extra_vocab_size": taken("--lora-extra-vocab-size", INT, "adapters that add tokens (a resized "
                                   "vocabulary, or vLLM's new_embeddings.safetensors) are refused when loaded "
                                   "(vLLM dropped extra-vocabulary LoRA too, #28382), so no room is reserved"),
    # ObservabilityConfig
    "show_hidden_metrics_for_version": taken("--show-hidden-metrics-for-version", STR, "loraplex's "
                                             "/metrics has one fixed set of vllm:* names, none hidden"),
    "collect_detailed_traces": refused("--collect-detailed-traces", STR, NO_TRACING),
    "aggregate_engine_logging": taken("--aggregate-engine-logging", BOOL, "one engine: its statistics are "
                                      "the aggregate"),
    # SchedulerConfig: the order prefills share a step in changes speed, not outputs
    **{dest: taken(flags, options, "scheduling order and step sizes change speed, not outputs")
       for dest, flags, options in (
        ("max_num_partial_prefills", "--max-num-partial-prefills", INT),
        ("max_long_partial_prefills", "--max-long-partial-prefills", INT),
        ("long_prefill_token_threshold", "--long-prefill-token-threshold", INT),
        ("scheduler_delay_factor", "--scheduler-delay-factor", FLOAT),
        ("performance_mode", "--performance-mode", STR),
    )},
    "num_lookahead_slots": taken("--num-lookahead-slots", INT, "room for speculative tokens, which loraplex "
                                 "sizes from --speculative-config"),
    "scheduler_cls": refused("--scheduler-cls", STR, f"{NO_PLUGINS}; its policies are --scheduling-policy "
                             "fair|fcfs|priority"),
    "disable_hybrid_kv_cache_manager": taken("--disable-hybrid-kv-cache-manager", BOOL, "how vLLM shares "
                                             "cache memory between attention kinds; loraplex has its own layout"),
    "num_scheduler_steps": taken_if("--num-scheduler-steps", INT, _equals(1), "one step per schedule",
                                    "multi-step scheduling is gone from vLLM's V1 engine too; loraplex "
                                    "schedules every step"),
    "preemption_mode": taken_if("--preemption-mode", STR, _equals("recompute"), "preempted requests are "
                                "recomputed", "loraplex recomputes preempted requests (as vLLM's V1 engine); "
                                "it swaps nothing to CPU memory"),
    "use_v2_block_manager": taken("--use-v2-block-manager", BOOL, "loraplex has one block manager"),
    "disable_async_output_proc": taken("--disable-async-output-proc", BOOL, "output processing overlap "
                                       "changes speed, not outputs"),
    # CompilationConfig: loraplex compiles nothing; graphs follow --cuda-graphs / --enforce-eager
    "cudagraph_capture_sizes": taken("--cudagraph-capture-sizes", {"type": int, "nargs": "+"}, "which batch "
                                     "sizes get a CUDA graph changes speed; loraplex captures its own buckets"),
    "max_cudagraph_capture_size": taken("--max-cudagraph-capture-size", INT, "CUDA-graph sizes change speed, "
                                        "not outputs"),
    "attention_backend": taken("--attention-backend", STR, "loraplex runs its own attention kernels, which "
                               "compute the same attention"),
    # AttentionConfig (later releases): the backend again (--attention-backend's JSON twin) and
    # per-kernel choices (flash-attention version, split counts, TRT-LLM / cuDNN prefill...)
    "attention_config": taken("--attention-config -ac", JSON, "which attention kernels vLLM picks; "
                              "loraplex runs its own, which compute the same attention"),
    # VllmConfig
    "kv_events_config": refused("--kv-events-config", JSON, "loraplex publishes no KV cache events"),
    "additional_config": refused("--additional-config", JSON, "loraplex takes no platform-specific options"),
    # vLLM's run_batch's own flags (vllm/entrypoints/openai/run_batch.py): `loraplex run-batch` only
    "output_tmp_dir": taken("--output-tmp-dir", STR, "vLLM stages uploads to an output URL there; loraplex "
                            "writes a local file (a hidden file beside it, renamed once every line is answered)"),
    "enable_metrics": refused("--enable-metrics", BOOL, "loraplex run-batch serves no Prometheus metrics: "
                              "progress goes to stderr and each line's usage is in the output file"),
    "url": taken("--url", STR, "the metrics server's address, which only --enable-metrics uses"),
    "port": taken("--port", INT, "the metrics server's port, which only --enable-metrics uses"),
    "max_log_len": taken("--max-log-len", INT, "loraplex logs no prompts"),
    # speculative decoding's older flags, before --speculative-config
    **{dest: refused(flags, options, "give --speculative-config '{\"method\": \"ngram\", "
                     "\"num_speculative_tokens\": K}' (n-gram is the method loraplex runs)")
       for dest, flags, options in (
        ("speculative_model", "--speculative-model", STR),
        ("num_speculative_tokens", "--num-speculative-tokens", INT),
        ("ngram_prompt_lookup_max", "--ngram-prompt-lookup-max", INT),
        ("ngram_prompt_lookup_min", "--ngram-prompt-lookup-min", INT),
    )},
}
