"""OpenAI's Batch file format, as vLLM's ``run_batch`` reads and writes it: JSON lines in, one
result line out per request line, in input order.

A request line::

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

``url`` is one of ``SUPPORTED_URLS``; ``method`` may be left out (POST is the only one taken).
Blank lines are skipped, as vLLM does. A result line::

    {"id": "batch_req_<hex>", "custom_id": "req-1",
     "response": {"status_code": 200, "request_id": "chatcmpl-...", "body": {...}}, "error": null}

where ``body`` is what the server answers for that body (an error envelope with a 4xx status for
an invalid one, as OpenAI's batch output holds it). A line that is no request at all (not JSON,
no ``custom_id``, ``url`` or ``body``, an unsupported ``url`` or ``method``, a ``custom_id`` an
earlier line already used) gets ``"response": null`` and ``"error": {"code", "message",
"param", "line"}``, the fields of OpenAI's batch errors (``line`` counts from 1).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

SUPPORTED_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


@dataclass
class BatchRequest:
    """One request line: its line number (from 1), ``custom_id``, ``url`` and JSON ``body``."""

    line: int
    custom_id: str
    url: str
    body: object


@dataclass
class LineError:
    """A line that is no request; written as a result line with a top-level ``error``."""

    line: int
    custom_id: str | None
    code: str
    message: str
    param: str | None = None


def parse_lines(data: bytes) -> list[BatchRequest | LineError]:
    """Every non-blank line of a batch file, as a request or as the reason it is none."""
    items: list[BatchRequest | LineError] = []
    seen: dict[str, int] = {}  # custom_id -> the line that used it first
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        item = parse_line(number, raw)
        if isinstance(item, BatchRequest):
            first = seen.setdefault(item.custom_id, number)
            if first != number:
                item = LineError(number, item.custom_id, "duplicate_custom_id",
                                 f"custom_id {item.custom_id!r} was already used on line {first}; "
                                 "each line needs its own.", "custom_id")
        items.append(item)
    return items


def parse_line(number: int, raw: bytes) -> BatchRequest | LineError:
    try:
        line = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return LineError(number, None, "invalid_json_line", f"Line {number} is not UTF-8 text.")
    except (ValueError, RecursionError):
        return LineError(number, None, "invalid_json_line", f"Line {number} is not valid JSON.")
    if not isinstance(line, dict):
        return LineError(number, None, "invalid_json_line", f"Line {number} is not a JSON object.")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not _is_text(custom_id):
        return LineError(number, None, "missing_required_parameter",
                         f"Line {number} needs `custom_id`, a string.", "custom_id")
    for name in ("url", "body"):
        if name not in line:
            return LineError(number, custom_id, "missing_required_parameter",
                             f"Line {number} needs `{name}`.", name)
    url, method = line["url"], line.get("method", "POST")
    if url not in SUPPORTED_URLS:
        return LineError(number, custom_id, "invalid_url",
                         f"Line {number}: `url` {url!r} is not supported; use one of {', '.join(SUPPORTED_URLS)}.",
                         "url")
    if method != "POST":
        return LineError(number, custom_id, "invalid_method",
                         f"Line {number}: `method` must be \"POST\", not {method!r}.", "method")
    return BatchRequest(number, custom_id, url, line["body"])


def _is_text(value: str) -> bool:
    """False for a string holding a lone surrogate (``"\\ud800"`` is valid JSON, but no UTF-8
    output line could hold it)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def new_batch_request_id() -> str:
    return "batch_req_" + uuid.uuid4().hex


def result_line(custom_id: str, status: int, request_id: str, body: dict) -> dict:
    """The result of a request line: the server's status and answer body."""
    return {
        "id": new_batch_request_id(),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }


def error_line(err: LineError) -> dict:
    """The result of a line that is no request."""
    return {
        "id": new_batch_request_id(),
        "custom_id": err.custom_id,
        "response": None,
        "error": {"code": err.code, "message": err.message, "param": err.param, "line": err.line},
    }


def dump_line(result: dict) -> str:
    """One output line (UTF-8 text, not ASCII escapes, as the server's answers)."""
    return json.dumps(result, ensure_ascii=False, separators=(",", ":")) + "\n"
