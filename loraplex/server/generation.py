"""From a validated request to engine deltas: model resolution, tokenization, admission, and
the per-request bookkeeping (tenant slot, adapter in-use pin, metrics, usage accounting, the
access log line).

A request resolves its ``model`` once, at admission, to an ``AdapterRef`` carrying the version's
content hash; the engine runs every token of it with that hash. A hot-swap after admission only
changes what later requests resolve to, so no request mixes two versions.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from jinja2 import TemplateError
from starlette.concurrency import run_in_threadpool

from loraplex.beam_search import BeamSearchParams
from loraplex.chat_content import shape_messages
from loraplex.engine.beam_search_async import beam_search_outputs
from loraplex.lora.errors import InvalidAdapterError
from loraplex.server.context import AppContext
from loraplex.server.errors import APIError, bad_request, clipped, model_not_found
from loraplex.server.prompt_fields import PromptOptions
from loraplex.server.rate_limits import TokenCost
from loraplex.server.request_ids import RequestIds
from loraplex.server.protocol import GenerationRequest
from loraplex.server.template_guard import render_limited
from loraplex.server.tenant_limits import DEFAULT_LIMITS, TenantLimits
from loraplex.template_content_format import ContentFormatResolver, template_text

access_log = logging.getLogger("loraplex.access")


@dataclass
class Target:
    """What a request's ``model`` resolved to."""

    model: str  # as the client wrote it; echoed in responses
    adapter: object | None  # loraplex.lora.spec.AdapterRef, None for the base model
    label: str | None  # "tenant/name" for metrics, None for the base model
    version: int | None
    # called once the run lets go of ``adapter`` (merged_adapters: drop merges forgotten meanwhile)
    after_release: Callable[[], None] | None = None


async def resolve_target(ctx: AppContext, tenant: str, model: str) -> Target:
    if model == ctx.served_model_name:
        return Target(model=model, adapter=None, label=None, version=None)
    try:
        # acquire: the version's files stay (no eviction, no delete) until RequestRun releases
        ref = await run_in_threadpool(lambda: ctx.adapters.resolve(tenant, model, acquire=True))
    except APIError:
        raise
    except Exception as exc:
        status = getattr(exc, "http_status", None)
        if status in (400, 404):  # no such name, or one that could never be a name: same answer
            raise model_not_found(model) from None
        raise
    name, _, version = ref.name.partition("@")
    ctx.adapter_display[ref.content_hash] = f"{tenant}/{ref.name}"
    ctx.metrics.hash_labels[ref.content_hash] = f"{tenant}/{name}"
    return Target(model=model, adapter=ref, label=f"{tenant}/{name}", version=int(version) if version.isdigit() else None)


def vocab_size(ctx: AppContext) -> int:
    """The number of token ids the model knows (its embedding rows), else the tokenizer's."""
    return getattr(getattr(ctx.engine, "engine", None), "vocab_size", None) or len(ctx.tokenizer)


def tokenize_prompts(ctx: AppContext, req: GenerationRequest) -> list[list[int]]:
    """Token ids per prompt, as the offline engine would tokenize the same text, then cut to the
    request's ``truncate_prompt_tokens``."""
    tok = ctx.tokenizer
    opts = req.prompt_options
    add_special = opts.special_tokens_for(req.kind)
    if req.kind == "chat":
        if opts.chat_template is not None and not ctx.settings.trust_request_chat_template:
            # vLLM refuses it the same way (its _validate_chat_template): a template is code the
            # server runs, so the operator opts in
            raise bad_request(
                "`chat_template`: a chat template sent with the request is refused unless the server runs "
                "with --trust-request-chat-template (LORAPLEX_TRUST_REQUEST_CHAT_TEMPLATE), as vLLM does.",
                param="chat_template",
            )
        if opts.chat_template is None and not getattr(tok, "chat_template", None):
            raise bad_request("This model has no chat template; use /completions.", param="messages")
        text = render_chat(tok, req.messages, req.tools.tools, opts, max_model_len=ctx.max_model_len,
                           content_format=ctx.content_format)
        # the template holds its own special tokens (BOS ...); add_special_tokens adds the
        # tokenizer's on top, as vLLM does
        out = [list(tok(text, add_special_tokens=add_special)["input_ids"])]
    else:
        vocab = vocab_size(ctx)
        out = []
        for prompt in req.prompts:
            if isinstance(prompt, str):
                out.append(list(tok(prompt, add_special_tokens=add_special)["input_ids"]))
            else:  # token ids are the prompt as given: no special tokens added (vLLM)
                if any(t < 0 or t >= vocab for t in prompt):  # the engine's own bounds (prepare_request)
                    raise bad_request(f"prompt token ids must be in [0, {vocab})", param="prompt")
                out.append(list(prompt))
    return truncate_prompts(out, opts.truncate_prompt_tokens, ctx.max_model_len)


def truncate_prompts(prompts: list[list[int]], keep: int | None, max_model_len: int) -> list[list[int]]:
    """vLLM's ``truncate_prompt_tokens``: keep each prompt's last ``keep`` tokens (left
    truncation, vllm-project/vllm#3144); -1 means the context length; more than the context
    length is a 400 (vLLM's _validate_truncation_size)."""
    if keep is None:
        return prompts
    if keep == -1:
        keep = max_model_len
    if keep > max_model_len:
        raise bad_request(
            f"`truncate_prompt_tokens` ({keep}) is greater than the model's context length ({max_model_len}); "
            "select a smaller truncation size.",
            param="truncate_prompt_tokens",
        )
    return [ids[-keep:] for ids in prompts]


# what a chat template that cannot render a conversation raises: its own raise_exception (a
# TemplateError, which also covers a request template's syntax errors and the sandbox's
# SecurityError), or a type or lookup error on a message shape it does not expect
_TEMPLATE_ERRORS = (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)


def render_chat(tok, messages: list[dict], tools: list[dict] | None, opts: PromptOptions | None = None,
                max_model_len: int | None = None, content_format: ContentFormatResolver | None = None) -> str:
    """The chat template over the messages, with the request's tools passed as ``tools`` and its
    ``documents`` as ``documents`` (as vLLM does; templates that know them show them to the
    model), and the request's template options (``opts``). A template that cannot render the
    conversation (say, one that refuses the role "tool") is a 400, naming ``chat_template`` for
    the request's own template, ``continue_final_message`` when that is what failed, and
    ``tools`` or ``documents`` when the same messages render without it. The request's own
    template renders within template_guard.py's limits (``max_model_len`` sizes its text).
    Message content reaches the template in the format ``content_format`` resolves for the
    template rendered (the request's, else the tokenizer's; vLLM's --chat-template-content-format,
    default auto: loraplex/chat_content.py)."""
    opts = opts or PromptOptions()
    fmt = (content_format or ContentFormatResolver()).format_for(template_text(tok, opts.chat_template, tools))
    messages = shape_messages(messages, fmt)
    kwargs = dict(opts.chat_template_kwargs)
    if opts.chat_template is not None:
        # rendered by transformers in its ImmutableSandboxedEnvironment, like the model's own
        kwargs["chat_template"] = opts.chat_template
    if opts.continue_final_message:
        kwargs["continue_final_message"] = True
    if tools:
        kwargs["tools"] = tools
    if opts.documents is not None:
        kwargs["documents"] = opts.documents

    def render(**kw) -> str:
        def run() -> str:
            return tok.apply_chat_template(messages, add_generation_prompt=opts.add_generation_prompt,
                                           tokenize=False, **kw)
        if "chat_template" in kw:
            return render_limited(run, max_model_len or 1 << 20)
        return run()

    try:
        return render(**kwargs)
    except _TEMPLATE_ERRORS as exc:
        param = "messages"
        if opts.chat_template is not None:
            param = "chat_template"
        elif opts.continue_final_message and "continue_final_message" in str(exc):
            param = "continue_final_message"
        else:
            for extra in ("tools", "documents"):
                if extra not in kwargs:
                    continue
                try:
                    render(**{k: v for k, v in kwargs.items() if k != extra})
                except _TEMPLATE_ERRORS:
                    continue
                param = extra
                break
        what = f"these {param}" if param in ("tools", "documents") else "this conversation"
        whose = "The request's chat template" if param == "chat_template" else "The model's chat template"
        raise bad_request(f"{whose} cannot render {what}: {exc}", param=param) from None


def cache_salt(scope: str, tenant: str, request_salt: str | None) -> str | None:
    """The engine's prefix-cache salt: per tenant (scope "tenant", the default), so no tenant can
    time whether another's prompt is cached (vLLM's CVE-2025-46570), and the request's own
    ``cache_salt`` within that. JSON keeps the parts apart: no salt a client sends can spell
    another tenant's."""
    if scope == "shared":
        return request_salt
    return json.dumps(["tenant", tenant, request_salt])


class RequestRun:
    """One admitted generation request. ``close`` gives everything back exactly once."""

    def __init__(self, ctx: AppContext, tenant: str, target: Target, req: GenerationRequest,
                 prompt_ids: list[list[int]], request_id: str, arrival: float,
                 limits: TenantLimits = DEFAULT_LIMITS, client_request_id: str | None = None):
        self.ctx = ctx
        self.tenant = tenant
        self.limits = limits  # the tenant's cap and scheduling weight when it was admitted
        self.target = target
        self.req = req
        self.prompt_ids = prompt_ids
        self.request_id = request_id
        self.client_request_id = client_request_id  # logged only: no key inside the server
        self.arrival = arrival
        # the server's own id: unique whatever X-Request-Id two clients send
        self.engine_ids = [f"{request_id}-{i}" for i in range(len(prompt_ids))]
        self.prompt_tokens = sum(len(p) for p in prompt_ids)
        self.completion_tokens = 0
        # per prompt, its tokens served from the prefix cache (the engine's num_cached_tokens,
        # known from its first output on); None until then
        self.cached_per_prompt: list[int | None] = [None] * len(prompt_ids)
        self.first_token_at: float | None = None
        self.finish_reasons: list[str] = []
        self.output_texts: list[str] = []  # each choice's whole text, once a whole answer is collected
        # prompt index -> the engine's prompt logprobs ([None, {...}, ...]), once computed
        self.prompt_logprobs: dict[int, list] = {}
        self._closed = False
        self._held: list[str] = []
        self._rate = None  # rate_limits.Reservation while held; None without rate limits
        self._gens: list | None = None  # the engine streams, once ``start`` submitted them

    @property
    def cached_tokens(self) -> int:
        """The prompt tokens of all prompts that the prefix cache served (a part of
        ``prompt_tokens``, as OpenAI's ``prompt_tokens_details.cached_tokens``)."""
        return sum(c for c in self.cached_per_prompt if c is not None)

    @property
    def rate_headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers as of this run's admission (none without rate limits)."""
        return dict(self._rate.headers) if self._rate is not None else {}

    def token_cost(self) -> TokenCost:
        """What the tokens-per-minute limit reserves: every prompt token, and max_tokens for each
        of the n completions of each prompt (``TokenCost.reserved``)."""
        return TokenCost(self.prompt_tokens, self.req.params.max_tokens, self.req.params.n * len(self.prompt_ids),
                         max_tokens_given=self.req.max_tokens_given)

    # --- admission ---------------------------------------------------------------------------

    def admit(self) -> None:
        """Take a drain slot (503), the tenant's rate limits (429, or 400 for a request larger
        than a minute's tokens) and a tenant slot (429). The adapter version was acquired by
        ``resolve_target``; from here on this run releases it."""
        ctx = self.ctx
        if self.target.adapter is not None:
            self._held.append("adapter")
        try:
            ctx.lifecycle.admit()
            self._held.append("lifecycle")
            limits, replicas = self.limits, ctx.live_replicas
            self._rate = ctx.rate_limiter.reserve(
                self.tenant, limits.max_requests_per_minute, limits.max_tokens_per_minute, self.token_cost(),
                prompt_param="messages" if self.req.kind == "chat" else "prompt", replicas=replicas)
            ctx.limiter.acquire(self.tenant, limits.concurrency_cap(replicas))
            self._held.append("limiter")
        except BaseException:
            ctx.rate_limiter.cancel(self._rate)  # refused after the rate take: it gets all of it back
            self._release()
            raise
        ctx.metrics.request_started(self.target.label, self.tenant)

    def _release(self) -> None:
        ctx = self.ctx
        if "adapter" in self._held:
            ctx.adapters.release(self.target.adapter.content_hash)
            if self.target.after_release is not None:
                self.target.after_release()
        if "limiter" in self._held:
            ctx.limiter.release(self.tenant)
        if "lifecycle" in self._held:
            ctx.lifecycle.done()
        self._held.clear()

    # --- running -----------------------------------------------------------------------------

    def start(self) -> None:
        """Submit the engine requests (one per prompt) that ``deltas`` reads; from here on an
        ``engine.abort`` of their ids counts (``AsyncLLMEngine.generate``), though ``deltas`` is
        read some event-loop ticks later (SGLang's /abort_request may come in between). Called
        by ``deltas`` when nobody did before."""
        if self._gens is not None:
            return
        salt = cache_salt(self.ctx.settings.prefix_cache_scope, self.tenant, self.req.prompt_options.cache_salt)
        run = beam_search_run(self) if self.req.beam is not None else self.ctx.engine.generate
        self._gens = [
            run(ids, self.req.params, request_id=rid, adapter=self.target.adapter, cache_salt=salt,
                priority=self.req.priority, tenant=self.tenant, tenant_weight=self.limits.scheduling_weight)
            for ids, rid in zip(self.prompt_ids, self.engine_ids)
        ]

    async def deltas(self) -> AsyncIterator[tuple[int, int, object]]:
        """Yields ``(prompt_index, choice_index, CompletionOutput delta)`` from all prompts."""
        engine = self.ctx.engine
        n = self.req.params.n
        self.start()
        gens = self._gens
        last_token_at: dict[int, float] = {}
        cached = self.cached_per_prompt
        metrics = self.ctx.metrics
        itl = metrics.itl.labels(metrics.model_name)  # the labelled child, looked up once a run
        monotonic = time.monotonic
        # one prompt (the usual case): its engine stream is read here, not through _merge, an
        # async generator more per token
        single = len(gens) == 1
        source = gens[0] if single else _merge(gens)
        try:
            async for item in source:
                p_idx, out = (0, item) if single else item
                if out.prompt_logprobs is not None:
                    self.prompt_logprobs[p_idx] = out.prompt_logprobs
                if cached[p_idx] is None:
                    cached[p_idx] = out.num_cached_tokens
                for comp in out.outputs:
                    choice = p_idx * n + comp.index
                    now = monotonic()
                    if comp.token_ids:
                        self.completion_tokens += len(comp.token_ids)
                        if self.first_token_at is None:
                            self.first_token_at = now
                            metrics.first_token(self.target.label, now - self.arrival, self.tenant)
                        elif choice in last_token_at:
                            itl.observe(now - last_token_at[choice])
                        last_token_at[choice] = now
                    if comp.finish_reason is not None:
                        self.finish_reasons.append(comp.finish_reason)
                    yield p_idx, choice, comp
        except InvalidAdapterError as exc:
            raise self._without_local_path(exc) from None
        finally:
            for rid in self.engine_ids:  # idempotent for finished requests; frees blocks of others
                try:
                    engine.abort(rid)
                except Exception:  # pragma: no cover - abort must not mask the real outcome
                    pass
            await source.aclose()  # closing this closes (and so aborts) the engine streams

    def _without_local_path(self, exc: InvalidAdapterError) -> InvalidAdapterError:
        """The engine's adapter error with the server's own directory left out: a tenant learns
        what is wrong with the adapter, not where the server keeps its files (the log has both)."""
        path = getattr(self.target.adapter, "path", None)
        if not path or path not in str(exc):
            return exc
        access_log.warning("adapter %s failed to load (request %s): %s", self.target.label, self.request_id, exc)
        return type(exc)(str(exc).replace(path, "<adapter files>"), param=exc.param, code=exc.code)

    def withdraw(self, status: int) -> None:
        """Close an admitted run that never ran because another part of the same HTTP request
        was refused (an SGLang batch admits one run per adapter): what it took goes back whole,
        the rate limits' request and tokens included, and it counts no tokens."""
        self.ctx.rate_limiter.cancel(self._rate)
        self.prompt_tokens = 0
        self.close(status)

    def close(self, status: int) -> None:
        if self._closed:
            return
        self._closed = True
        self._release()
        # the unused part of max_tokens goes back; what the run used (if it failed: up to then) stays
        self.ctx.rate_limiter.finish(self._rate, self.prompt_tokens + self.completion_tokens)
        now = time.monotonic()
        finish = self.finish_reasons[0] if self.finish_reasons else None
        self.ctx.metrics.request_finished(
            self.target.label,
            got_first_token=self.first_token_at is not None,
            prompt_tokens=self.prompt_tokens if status == 200 else 0,
            gen_tokens=self.completion_tokens,
            e2e=now - self.arrival if status == 200 else None,
            finish_reason=finish if status == 200 else None,
            tenant=self.tenant,
        )
        adapter = self.target.label.split("/", 1)[1] if self.target.label else None
        if self.ctx.usage is not None:  # what the answer's `usage` reports (all the run used, if it failed)
            self.ctx.usage.record(self.tenant, adapter, prompt_tokens=self.prompt_tokens,
                                  completion_tokens=self.completion_tokens, ok=status == 200)
        record = {
            "event": "request",
            "request_id": self.request_id,
            "client_request_id": self.client_request_id,
            "tenant": self.tenant,
            "endpoint": self.req.endpoint,
            "stream": self.req.stream,
            "adapter": adapter,
            "version": self.target.version,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_s": round(self.first_token_at - self.arrival, 4) if self.first_token_at else None,
            "duration_s": round(now - self.arrival, 4),
            "finish_reason": finish,
            "status": status,
        }
        access_log.info(json.dumps(record, separators=(",", ":")))


def beam_search_run(run: RequestRun):
    """``engine.generate``'s form for a beam search request: its one final output holds the n
    best beams (loraplex/engine/beam_search_async.py)."""
    ctx, req = run.ctx, run.req
    core = ctx.engine.engine  # the LLMEngine: its end-of-sequence tokens

    def generate(ids, params, **kwargs):
        beam = BeamSearchParams(beam_width=params.n, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                                temperature=params.temperature, length_penalty=req.beam.length_penalty,
                                include_stop_str_in_output=params.include_stop_str_in_output)
        return beam_search_outputs(ctx.engine, ids, beam, eos_token_ids=core.scheduler.eos_token_ids,
                                   tokenizer=ctx.tokenizer, vocab_size=vocab_size(ctx),
                                   max_model_len=ctx.max_model_len, **kwargs)

    return generate


def log_refused(kind: str, tenant: str | None, model: str | None, status: int, arrival: float,
                ids: RequestIds | None = None) -> None:
    """The access line of a request refused before it reached the engine; ``ids`` are the HTTP
    request's (request_ids.py; none for a batch file's line)."""
    record = {
        "event": "request", "request_id": ids.server if ids else None,
        "client_request_id": ids.client if ids else None, "tenant": tenant, "endpoint": kind,
        "model": clipped(model) if isinstance(model, str) else model, "adapter": None, "version": None,
        "prompt_tokens": 0, "completion_tokens": 0, "ttft_s": None,
        "duration_s": round(time.monotonic() - arrival, 4), "finish_reason": None, "status": status,
    }
    access_log.info(json.dumps(record, separators=(",", ":")))


async def _merge(gens: list) -> AsyncIterator[tuple[int, object]]:
    """Interleave several engine streams; closing this closes (and so aborts) all of them."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen) -> None:
        try:
            async for item in gen:
                await queue.put((i, item, None))
            await queue.put((i, done, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            await queue.put((i, None, exc))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            i, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is done:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()
