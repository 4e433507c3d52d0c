"""Request limits checked before anything reaches the engine: body size (413), prompt length and
max_tokens against the context (400 ``context_length_exceeded``), n (400), and concurrent requests
per tenant (429 with Retry-After)."""

from __future__ import annotations

import json
import re
import threading
from collections import defaultdict

from starlette.requests import Request

from loraplex.server.errors import APIError, bad_request

RETRY_AFTER_SECONDS = 1


def payload_too_large(limit: int) -> APIError:
    return APIError(413, f"Request body larger than the limit of {limit} bytes.", code="payload_too_large")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole request body, refusing (413) more than ``max_bytes`` without buffering it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise payload_too_large(max_bytes)
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > max_bytes:
            raise payload_too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def max_prompt_len(max_model_len: int, max_prompt_tokens: int | None) -> int:
    """The longest prompt admitted: ``max_prompt_tokens`` when set, never more than the
    context leaves for one generated token."""
    cap = max_prompt_tokens if max_prompt_tokens is not None else max_model_len - 1
    return min(cap, max_model_len - 1)


def check_generation_limits(
    *, prompt_len: int, max_tokens: int | None, n: int, max_model_len: int, max_prompt_tokens: int | None, max_n: int
) -> int:
    """Validate one prompt against the context; returns the effective max_tokens."""
    if n > max_n:
        raise bad_request(f"`n` must be <= {max_n}, got {n}", param="n")
    if prompt_len == 0:
        raise bad_request("The prompt is empty.", param="prompt")
    prompt_cap = max_prompt_len(max_model_len, max_prompt_tokens)
    if prompt_len > prompt_cap:
        raise APIError(
            400,
            f"The prompt has {prompt_len} tokens; the maximum is {prompt_cap}.",
            param="prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. You requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
            "completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


class TenantConcurrencyLimiter:
    """Counts in-flight generation requests per tenant; refuses above the cap with 429. The cap
    is the tenant's own (``cap``, set by an operator) or else ``max_per_tenant``."""

    def __init__(self, max_per_tenant: int):
        self.max_per_tenant = max_per_tenant
        self._counts: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def acquire(self, tenant: str, cap: int | None = None) -> None:
        limit = self.max_per_tenant if cap is None else cap
        with self._lock:
            # a cap lowered below what is in flight refuses new requests until enough finish
            if self._counts[tenant] >= limit:
                raise APIError(
                    429,
                    f"Too many concurrent requests for this tenant (limit {limit}).",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
                )
            self._counts[tenant] += 1

    def release(self, tenant: str) -> None:
        with self._lock:
            self._counts[tenant] -= 1
            if self._counts[tenant] <= 0:
                del self._counts[tenant]

    def in_flight(self, tenant: str | None = None) -> int:
        with self._lock:
            return self._counts.get(tenant, 0) if tenant is not None else sum(self._counts.values())


class BodySizeLimitMiddleware:
    """ASGI middleware: refuses request bodies over ``max_bytes`` with 413, by declared length
    up front or by counting while the route reads (multipart uploads included)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                return await payload_too_large(self.max_bytes).response()(scope, receive, send)
        seen = 0

        async def counting_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise payload_too_large(self.max_bytes)
            return message

        await self.app(scope, counting_receive, send)


# a \uD800-\uDFFF escape: JSON lets one stand alone, but no UTF-8 text can hold it
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json(raw: bytes):
    """A request body's JSON; anything unparseable (nested deeper than the interpreter allows
    included: RecursionError) is a 400, and so is a string holding a lone surrogate escape
    (``"\\ud800"``): the tokenizer, the registry and the answer's own JSON would each fail on it
    with a 500."""
    try:
        body = json.loads(raw)
        if _SURROGATE_ESCAPE.search(raw):  # escaped pairs (emoji from ensure_ascii clients) are fine
            json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise bad_request("Request body holds a lone UTF-16 surrogate (\\uD800-\\uDFFF), which is not text.") from None
    except (ValueError, RecursionError):
        raise bad_request("Request body is not valid JSON.") from None
    return body


async def read_json(request: Request, max_bytes: int):
    """``read_body`` then ``parse_json``."""
    return parse_json(await read_body(request, max_bytes))
