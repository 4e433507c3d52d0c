"""Answering a batch file's lines in process: each request line goes through the server's own
admission and answer (admission.admit_body, openai_routes.whole_answer) with the route's own
``Admission``, so its result body is what a POST of the same body to ``loraplex serve`` answers,
ids and ``created`` aside. Lines run concurrently (at most ``max_concurrency`` at once) so the
engine batches them; results are written in input order as soon as all earlier ones are.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from loraplex.server.admission import Admission, admit_body
from loraplex.server.batch_file import BatchRequest, LineError, error_line, result_line
from loraplex.server.context import AppContext
from loraplex.server.errors import APIError, bad_request, from_exception
from loraplex.server.limits import parse_json
from loraplex.server.openai_routes import OpenAIAdmission, shaper_for, whole_answer
from loraplex.server.protocol import GenerationRequest, parse_chat_request, parse_completion_request
from loraplex.server.responses_routes import ResponsesAdmission, response_answer

# url -> (the route's admission steps, how its answer is made of the chat/completions body)
ROUTES: dict[str, tuple[Callable[[], Admission], Callable | None]] = {
    "/v1/chat/completions": (lambda: OpenAIAdmission("chat", parse_chat_request), None),
    "/v1/completions": (lambda: OpenAIAdmission("completion", parse_completion_request), None),
    "/v1/responses": (ResponsesAdmission, response_answer),
}


class BatchAdmission(Admission):
    """A route's admission, refusing ``stream``: a batch line's answer is written whole."""

    def __init__(self, route: Admission):
        self.route = route
        self.endpoint = route.endpoint

    def parse(self, ctx: AppContext, body) -> GenerationRequest:
        req = self.route.parse(ctx, body)
        if req.stream:
            raise bad_request("`stream` is not available in a batch file: each line's answer is written whole.",
                              param="stream")
        return req

    def prompt_ids(self, ctx: AppContext, req: GenerationRequest) -> list[list[int]]:
        return self.route.prompt_ids(ctx, req)

    async def resolve(self, ctx: AppContext, tenant: str, req: GenerationRequest):
        return await self.route.resolve(ctx, tenant, req)

    def request_id(self, req: GenerationRequest) -> str:
        return self.route.request_id(req)

    def refused_status(self, err: APIError) -> int:
        return self.route.refused_status(err)


async def answer_line(ctx: AppContext, tenant: str, item: BatchRequest | LineError) -> dict:
    """The result line of one input line; an error in one line never escapes it."""
    if isinstance(item, LineError):
        return error_line(item)
    make_admission, answer = ROUTES[item.url]
    arrival = time.monotonic()
    try:
        # the server's checks on a body's JSON (a lone surrogate escape is a 400), on the same text
        body = parse_json(json.dumps(item.body).encode())
        run = await admit_body(ctx, tenant, body, BatchAdmission(make_admission()), arrival)
        return result_line(item.custom_id, 200, run.request_id, await whole_answer(run, shaper_for(run), answer))
    except Exception as exc:
        err = from_exception(exc)  # an unknown error is a 500, logged as the server logs it
        return result_line(item.custom_id, err.status, "req_" + uuid.uuid4().hex, err.body())


@dataclass
class BatchSummary:
    """What a run did: lines by outcome, tokens, seconds."""

    lines: int = 0
    succeeded: int = 0  # status 200
    failed: int = 0  # a 4xx/5xx answer or a line that is no request
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)  # "200", "400", "invalid_json_line" ... -> lines

    def count(self, result: dict) -> None:
        self.lines += 1
        response = result["response"]
        key = str(response["status_code"]) if response else result["error"]["code"]
        self.statuses[key] = self.statuses.get(key, 0) + 1
        if response and response["status_code"] == 200:
            self.succeeded += 1
            usage = response["body"].get("usage") or {}
            # chat/completions name them prompt/completion tokens, the Responses API input/output
            self.prompt_tokens += usage.get("prompt_tokens", usage.get("input_tokens", 0))
            self.completion_tokens += usage.get("completion_tokens", usage.get("output_tokens", 0))
        else:
            self.failed += 1


class Progress:
    """``done/total`` lines on ``out`` (stderr), at most every ``interval`` seconds, and the last."""

    def __init__(self, total: int, out: TextIO | None = None, interval: float = 1.0):
        self.total = total
        self.out = out if out is not None else sys.stderr
        self.interval = interval
        self.done = 0
        self._last = 0.0

    def step(self) -> None:
        self.done += 1
        now = time.monotonic()
        if self.done == self.total or now - self._last >= self.interval:
            self._last = now
            percent = 100.0 * self.done / self.total if self.total else 100.0
            print(f"loraplex run-batch: {self.done}/{self.total} lines done ({percent:.0f}%)", file=self.out, flush=True)


async def run_lines(ctx: AppContext, tenant: str, items: list[BatchRequest | LineError], write: Callable[[dict], None],
                    max_concurrency: int, progress: Progress | None = None) -> BatchSummary:
    """Answer every line, at most ``max_concurrency`` at once, calling ``write`` with each
    result in input order."""
    summary = BatchSummary()
    start = time.monotonic()
    results: dict[int, dict] = {}  # index -> result not yet written (an earlier one still runs)
    next_to_write = 0
    queue = iter(range(len(items)))

    def flush() -> None:
        nonlocal next_to_write
        while next_to_write in results:
            result = results.pop(next_to_write)
            write(result)
            summary.count(result)
            next_to_write += 1

    async def worker() -> None:
        for index in queue:  # one shared iterator: each line is taken by one worker
            results[index] = await answer_line(ctx, tenant, items[index])
            flush()
            if progress is not None:
                progress.step()

    await asyncio.gather(*(worker() for _ in range(max(1, min(max_concurrency, len(items))))))
    flush()
    summary.seconds = time.monotonic() - start
    return summary
