"""What every route needs, built once per app and kept on ``app.state.ctx``."""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraplex.config import Settings
from loraplex.generation_defaults import SamplingDefaults
from loraplex.server.auth import AdminAuth, TenantAuth
from loraplex.server.lifecycle import Lifecycle
from loraplex.server.limits import TenantConcurrencyLimiter
from loraplex.server.metrics import ServerMetrics
from loraplex.server.rate_limits import TenantRateLimiter
from loraplex.server.sglang_calls import SGLangCalls
from loraplex.server.tenant_limits import TenantLimitsCache
from loraplex.template_content_format import ContentFormatResolver


@dataclass
class AppContext:
    """The wired parts: the engine (``AsyncLLMEngine``), the registry (``RegistryService``) and
    the adapter manager (``AdapterManager``), plus the server's own state."""

    settings: Settings
    engine: Any
    registry: Any
    adapters: Any
    served_model_name: str
    metrics: ServerMetrics
    limiter: TenantConcurrencyLimiter
    tenant_limits: TenantLimitsCache  # each tenant's own cap and scheduling weight
    lifecycle: Lifecycle
    tenant_auth: TenantAuth
    admin_auth: AdminAuth
    staging_root: Path
    tool_parser: Any = None  # tool_parsers.ToolCallParser, from --tool-call-parser
    reasoning_parser: Any = None  # reasoning_parsers.ReasoningParser, from --reasoning-parser
    chat_template: str | None = None  # --chat-template's text, put on the tokenizer once it is built
    # --chat-template-content-format: the shape message content reaches the template in, detected
    # once per template under "auto" (loraplex/template_content_format.py)
    content_format: ContentFormatResolver = field(default_factory=ContentFormatResolver)
    usage: Any = None  # usage_recorder.UsageRecorder once started; None: usage accounting off
    # LoRAX's merged_adapters (registry/adapter_merges.AdapterMerger); None where the adapter
    # store has no disk cache to put merges in (the offline batch runner's)
    merges: Any = None
    # merge requests resolving now, by (tenant, ids, params): an identical one waits on the event
    # loop for it, not on a thread-pool thread every other route needs (merged_adapters.py)
    merges_resolving: dict = field(default_factory=dict)
    # housekeeping started from a sync place on the loop (merged_adapters.drop_forgotten_merges_soon)
    housekeeping_tasks: set = field(default_factory=set)
    # each tenant's requests- and tokens-per-minute buckets on this replica
    rate_limiter: TenantRateLimiter = field(default_factory=TenantRateLimiter)
    # the live replicas sharing the tenant limits (cluster_presence.ClusterPresence), under
    # --tenant-limits-scope cluster once started; None: this replica applies them whole
    presence: Any = None
    # content hash -> display name ("tenant/name@version"), for status and logs
    adapter_display: dict[str, str] = field(default_factory=dict)
    # SGLang /generate calls in flight, for /abort_request (sglang_abort.py)
    sglang_calls: SGLangCalls = field(default_factory=SGLangCalls)
    # where prompts are rendered and tokenized (``run_tokenizer``); threads start on first use
    tokenizer_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="loraplex-tokenize"))

    @property
    def live_replicas(self) -> int:
        """How many replicas share each tenant's limits: 1 under the replica scope."""
        return self.presence.live if self.presence is not None else 1

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        """The engine's defaults for sampling fields a request leaves unset (--generation-config)."""
        return getattr(self.engine, "sampling_defaults", None) or SamplingDefaults()

    async def run_tokenizer(self, fn, *args):
        """``fn(*args)`` (chat rendering, tokenizing, decoding) on the tokenizer thread. Encoding a
        35k-token prompt takes about 100 ms here; on the event loop that would hold every open
        stream's next chunk as long, while the fast tokenizer lets go of the GIL. One thread: a
        fast tokenizer used from several threads at once can fail with "Already borrowed"
        (huggingface/tokenizers#537), and one queue keeps requests in arrival order."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, functools.partial(fn, *args))

    def engine_stats(self) -> dict:
        return self.engine.stats() if self.engine is not None else {}
