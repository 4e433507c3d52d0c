"""Prometheus metrics, on a CollectorRegistry owned by one app (never the process-global one, so
two apps in one process, as in tests, do not collide).

vLLM's names, which the Kubernetes Gateway API Inference Extension reads:
``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
(a fraction in [0, 1], as vLLM reports it), ``vllm:lora_requests_info`` (labels
running_lora_adapters, waiting_lora_adapters, max_lora; value: the time of the scrape),
``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
``vllm:e2e_request_latency_seconds``, ``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``, ``vllm:prefix_cache_queries_total``,
``vllm:prefix_cache_hits_total`` (prompt tokens; hit rate = hits / queries; each sequence's
first admission only, as vLLM: re-admissions after preemption count neither, nor do
sequences that skip the lookup for prompt logprobs),
``vllm:spec_decode_num_drafts_total``, ``vllm:spec_decode_num_draft_tokens_total``,
``vllm:spec_decode_num_accepted_tokens_total`` (speculative decoding; acceptance rate =
accepted / draft tokens; all 0 without ``--speculative-config``).

loraplex's own: ``loraplex_adapters{tier}``, ``loraplex_adapter_loads_total``,
``loraplex_adapter_evictions_total``, ``loraplex_adapter_load_seconds_total``,
``loraplex_adapter_requests_total{adapter}``, ``loraplex_adapter_tokens_total{adapter,kind}``,
``loraplex_http_requests_total{route,status}``, ``loraplex_tenant_limit_replicas`` (the live
replicas among which each tenant's limits are shared under ``--tenant-limits-scope cluster``;
1 otherwise). Adapter labels are ``tenant/name`` (never a
version or hash); past ``max_adapter_labels`` distinct values new adapters are counted under
``__other__`` so the series count stays bounded.

Per tenant (base model and adapters together; what a fair share or a bill is about):
``loraplex_tenant_requests_in_flight{tenant,state}`` (waiting / running, as the server sees
them: waiting until the first token),
``loraplex_tenant_requests_total{tenant}``, ``loraplex_tenant_tokens_total{tenant,kind}``
(prompt / generation) and ``loraplex_tenant_time_to_first_token_seconds{tenant}``; tenant labels
are bounded the same way (``max_adapter_labels``, then ``__other__``).

Running/waiting LoRA adapters are seen from the server: a request is waiting until its first
token arrives, running after.
"""

from __future__ import annotations

import threading
import time
from collections import Counter as Multiset
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OTHER_LABEL = "__other__"
TIERS = ("device", "host", "disk")

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


def _num(stats: dict, *names: str, default: float = 0.0) -> float:
    """The first of ``names`` present in the engine's stats dict (its key names are the engine's)."""
    for name in names:
        value = stats.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return default


def lora_stats(stats: dict) -> dict:
    lora = stats.get("lora")
    return lora if isinstance(lora, dict) else {}


def adapter_totals(stats: dict) -> dict:
    """Loads, evictions, host loads and load seconds summed over the engine's per-adapter counters,
    those of adapters it has forgotten included (a counter never goes back)."""
    totals = {"loads": 0.0, "evictions": 0.0, "host_loads": 0.0, "load_seconds": 0.0}
    lora = lora_stats(stats)
    adapters = lora.get("adapters") or {}
    forgotten = lora.get("forgotten")
    entries = list(adapters.values()) if isinstance(adapters, dict) else []
    for entry in entries + ([forgotten] if isinstance(forgotten, dict) else []):
        for key in totals:
            totals[key] += _num(entry, key)
    return totals


class ServerMetrics:
    """All metrics of one app. Request-level series are observed by the routes; engine and
    adapter state is read from ``stats_source()`` at scrape time."""

    def __init__(self, model_name: str, max_lora: int, max_adapter_labels: int = 256):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.max_lora = max_lora
        self.max_adapter_labels = max_adapter_labels
        self.stats_source: Callable[[], dict] = dict
        self.disk_entries: Callable[[], int] = lambda: 0  # adapters in the local disk cache
        # replicas sharing each tenant's limits (1 under --tenant-limits-scope replica)
        self.limit_replicas: Callable[[], int] = lambda: 1
        self.hash_labels: dict[str, str] = {}  # adapter content hash -> "tenant/name"
        self._lock = threading.Lock()
        self._adapter_labels: set[str] = set()
        self._waiting: Multiset[str] = Multiset()
        self._running: Multiset[str] = Multiset()
        self._tenant_labels: set[str] = set()
        self._tenant_state: dict[str, Multiset[str]] = {"waiting": Multiset(), "running": Multiset()}
        labels = ["model_name"]
        reg = self.registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels, registry=reg, buckets=_TTFT_BUCKETS)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", labels, registry=reg, buckets=_ITL_BUCKETS)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", labels, registry=reg, buckets=_E2E_BUCKETS)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=reg)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens produced.", labels, registry=reg)
        self.request_success = Counter("vllm:request_success", "Finished requests.", labels + ["finished_reason"], registry=reg)
        self.adapter_requests = Counter("loraplex_adapter_requests", "Requests per adapter.", ["adapter"], registry=reg)
        self.adapter_tokens = Counter("loraplex_adapter_tokens", "Tokens per adapter.", ["adapter", "kind"], registry=reg)
        self.http_requests = Counter("loraplex_http_requests", "HTTP requests by route and status.", ["route", "status"], registry=reg)
        self.tenant_requests = Counter("loraplex_tenant_requests", "Finished requests per tenant.", ["tenant"], registry=reg)
        self.tenant_tokens = Counter("loraplex_tenant_tokens", "Tokens per tenant.", ["tenant", "kind"], registry=reg)
        self.tenant_ttft = Histogram("loraplex_tenant_time_to_first_token_seconds", "Time to first token per tenant.",
                                     ["tenant"], registry=reg, buckets=_TTFT_BUCKETS)
        reg.register(_EngineCollector(self))

    # --- called by the routes --------------------------------------------------------------

    def adapter_label(self, adapter: str | None) -> str:
        if adapter is None:
            return "base"
        return self._bounded(adapter, self._adapter_labels)

    def tenant_label(self, tenant: str) -> str:
        return self._bounded(tenant, self._tenant_labels)

    def _bounded(self, value: str, known: set[str]) -> str:
        with self._lock:
            if value in known:
                return value
            if len(known) < self.max_adapter_labels:
                known.add(value)
                return value
        return OTHER_LABEL

    def request_started(self, adapter: str | None, tenant: str | None = None) -> None:
        with self._lock:
            if adapter is not None:
                self._waiting[adapter] += 1
        if tenant is not None:
            self._move_tenant(self.tenant_label(tenant), None, "waiting")

    def first_token(self, adapter: str | None, ttft: float, tenant: str | None = None) -> None:
        self.ttft.labels(self.model_name).observe(ttft)
        if adapter is not None:
            with self._lock:
                self._waiting[adapter] -= 1
                self._running[adapter] += 1
        if tenant is not None:
            label = self.tenant_label(tenant)
            self.tenant_ttft.labels(label).observe(ttft)
            self._move_tenant(label, "waiting", "running")

    def _move_tenant(self, label: str, source: str | None, target: str | None) -> None:
        with self._lock:
            if source is not None:
                bucket = self._tenant_state[source]
                bucket[label] -= 1
                if bucket[label] <= 0:
                    del bucket[label]
            if target is not None:
                self._tenant_state[target][label] += 1

    def tenant_states(self) -> dict[str, dict[str, int]]:
        """{state: {tenant label: requests}} for the tenants with requests in flight."""
        with self._lock:
            return {state: dict(counts) for state, counts in self._tenant_state.items()}

    def request_finished(
        self, adapter: str | None, *, got_first_token: bool, prompt_tokens: int, gen_tokens: int,
        e2e: float | None, finish_reason: str | None, tenant: str | None = None,
    ) -> None:
        if adapter is not None:
            with self._lock:
                bucket = self._running if got_first_token else self._waiting
                bucket[adapter] -= 1
                if bucket[adapter] <= 0:
                    del bucket[adapter]
        if tenant is not None:
            who = self.tenant_label(tenant)
            self._move_tenant(who, "running" if got_first_token else "waiting", None)
            self.tenant_requests.labels(who).inc()
            self.tenant_tokens.labels(who, "prompt").inc(prompt_tokens)
            self.tenant_tokens.labels(who, "generation").inc(gen_tokens)
        label = self.adapter_label(adapter)
        self.adapter_requests.labels(label).inc()
        self.adapter_tokens.labels(label, "prompt").inc(prompt_tokens)
        self.adapter_tokens.labels(label, "generation").inc(gen_tokens)
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)
        self.generation_tokens.labels(self.model_name).inc(gen_tokens)
        if e2e is not None:
            self.e2e.labels(self.model_name).observe(e2e)
        if finish_reason is not None:
            self.request_success.labels(self.model_name, finish_reason).inc()

    def lora_adapters(self, stats: dict | None = None) -> tuple[list[str], list[str]]:
        """(running, waiting) adapter labels. Running comes from the engine's
        ``running_adapters`` (content hashes, named through ``hash_labels``) when it reports
        them; waiting are adapters with admitted requests not yet running."""
        with self._lock:
            running = {a for a, c in self._running.items() if c > 0}
            waiting = {a for a, c in self._waiting.items() if c > 0}
        engine_running = (stats or {}).get("running_adapters")
        if isinstance(engine_running, (list, tuple, set)):
            running = {self.hash_labels.get(h, h[:12]) for h in engine_running if isinstance(h, str)}
        return sorted(running), sorted(waiting - running)

    def tier_counts(self, stats: dict) -> dict:
        tiers = lora_stats(stats).get("tiers") or {}
        try:
            disk = float(self.disk_entries())
        except Exception:
            disk = 0.0
        return {"device": _num(tiers, "device"), "host": _num(tiers, "host"), "disk": disk}

    def summary(self) -> dict:
        """Engine and request figures for the admin status page (cumulative counters)."""
        try:
            stats = self.stats_source() or {}
        except Exception:
            stats = {}
        totals = adapter_totals(stats)
        def sample(metric, suffix: str) -> float:
            return sum(
                s.value for fam in metric.collect() for s in fam.samples if s.name.endswith(suffix)
            )

        return {
            "num_requests_running": _num(stats, "num_requests_running", "num_running"),
            "num_requests_waiting": _num(stats, "num_requests_waiting", "num_waiting"),
            "kv_cache_usage": _num(stats, "kv_cache_usage"),
            "adapters_per_tier": self.tier_counts(stats),
            "loads": totals["loads"],
            "evictions": totals["evictions"],
            "prompt_tokens_total": sample(self.prompt_tokens, "_total"),
            "generation_tokens_total": sample(self.generation_tokens, "_total"),
            "ttft_sum_seconds": sample(self.ttft, "_sum"),
            "ttft_count": sample(self.ttft, "_count"),
        }

    def render(self) -> bytes:
        return generate_latest(self.registry)


class HttpMetricsMiddleware:
    """ASGI middleware counting responses by endpoint (a bounded set of names) and status."""

    def __init__(self, app, metrics: "ServerMetrics"):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_wrapper(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            endpoint = scope.get("endpoint")
            name = getattr(endpoint, "__name__", None) or ("static" if endpoint is not None else "unmatched")
            self.metrics.http_requests.labels(name, str(status)).inc()


class _EngineCollector:
    """Scrape-time view of the engine and adapter tiers."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        m = self.metrics
        try:
            stats = m.stats_source() or {}
        except Exception:  # a scrape must not fail because the engine is busy or gone
            stats = {}
        labels = ["model_name"]
        for name, doc, keys in (
            ("vllm:num_requests_running", "Requests running on the engine.", ("num_requests_running", "num_running")),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", ("num_requests_waiting", "num_waiting")),
            ("vllm:kv_cache_usage_perc", "KV cache usage (1 = 100%).", ("kv_cache_usage",)),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([m.model_name], _num(stats, *keys))
            yield g
        for name, doc, key in (  # vLLM v1's names; both count prompt tokens
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
            # speculative decoding (vLLM's names): verified drafts, their tokens, those accepted
            ("vllm:spec_decode_num_drafts", "Speculative drafts verified (one per sequence and step).",
             "spec_decode_num_drafts"),
            ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", "spec_decode_num_draft_tokens"),
            ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", "spec_decode_num_accepted_tokens"),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([m.model_name], _num(stats, key))
            yield c
        running, waiting = m.lora_adapters(stats)
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running and waiting LoRA adapters.",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        info.add_metric([",".join(running), ",".join(waiting), str(m.max_lora)], time.time())
        yield info
        tiers = GaugeMetricFamily("loraplex_adapters", "Adapters held per tier.", labels=["tier"])
        per_tier = m.tier_counts(stats)
        for tier in TIERS:
            tiers.add_metric([tier], per_tier[tier])
        yield tiers
        totals = adapter_totals(stats)
        for name, doc, key in (
            ("loraplex_adapter_loads", "Adapter loads into a device slot.", "loads"),
            ("loraplex_adapter_evictions", "Adapter evictions from a device slot.", "evictions"),
            # reads from disk into host memory: the first of each version, then every host miss
            ("loraplex_adapter_host_loads", "Adapter reads from disk into host memory.", "host_loads"),
            ("loraplex_adapter_load_seconds", "Seconds spent loading adapters (disk reads and device copies).", "load_seconds"),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], totals[key])
            yield c
        per_tenant = GaugeMetricFamily("loraplex_tenant_requests_in_flight",
                                       "Requests in flight per tenant: waiting (no token yet) or running.",
                                       labels=["tenant", "state"])
        for state, counts in m.tenant_states().items():
            for tenant, count in sorted(counts.items()):
                per_tenant.add_metric([tenant, state], count)
        yield per_tenant
        reading = GaugeMetricFamily("loraplex_adapter_host_reads_in_flight",
                                    "Adapters being read from disk into host memory off the engine thread.")
        reading.add_metric([], _num(lora_stats(stats), "host_reads_in_flight"))
        yield reading
        replicas = GaugeMetricFamily("loraplex_tenant_limit_replicas",
                                     "Replicas this one counts as sharing each tenant's limits (1: per replica).")
        replicas.add_metric([], m.limit_replicas())
        yield replicas
