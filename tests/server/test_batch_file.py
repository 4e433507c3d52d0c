"""OpenAI's batch file format as run-batch reads it (no engine): each line a request or the
reason it is none, and vLLM's two ``--lora-modules`` spellings."""

from __future__ import annotations

import json

import pytest

from loraplex.server.batch_adapters import LoraModule, parse_lora_module
from loraplex.server.batch_file import BatchRequest, LineError, dump_line, error_line, parse_lines, result_line

BODY = {"model": "m", "prompt": "hi"}


def _line(**fields) -> bytes:
    return json.dumps(fields).encode()


def test_request_lines_and_the_reason_each_bad_line_is_none():
    lines = [
        _line(custom_id="a", method="POST", url="/v1/chat/completions", body={"model": "m", "messages": []}),
        b"{not json",
        b"",  # blank lines are skipped, not answered
        b"[1, 2]",
        _line(url="/v1/completions", body=BODY),
        _line(custom_id=7, url="/v1/completions", body=BODY),
        _line(custom_id="b", url="/v1/completions"),
        _line(custom_id="c", body=BODY),
        _line(custom_id="d", url="/v1/embeddings", body=BODY),
        _line(custom_id="e", method="GET", url="/v1/completions", body=BODY),
        _line(custom_id="a", url="/v1/completions", body=BODY),
        b'{"custom_id": "\\ud800", "url": "/v1/completions", "body": {}}',
        b"\xff\xfe",
        _line(custom_id="f", url="/v1/responses", body="not an object"),  # the server's parser answers that
    ]
    items = parse_lines(b"\n".join(lines) + b"\n")
    assert items[0] == BatchRequest(1, "a", "/v1/chat/completions", {"model": "m", "messages": []})
    assert items[-1] == BatchRequest(14, "f", "/v1/responses", "not an object")
    errors = items[1:-1]
    assert all(isinstance(e, LineError) for e in errors)
    assert [(e.line, e.custom_id, e.code, e.param) for e in errors] == [
        (2, None, "invalid_json_line", None),
        (4, None, "invalid_json_line", None),
        (5, None, "missing_required_parameter", "custom_id"),
        (6, None, "missing_required_parameter", "custom_id"),
        (7, "b", "missing_required_parameter", "body"),
        (8, "c", "missing_required_parameter", "url"),
        (9, "d", "invalid_url", "url"),
        (10, "e", "invalid_method", "method"),
        (11, "a", "duplicate_custom_id", "custom_id"),
        (12, None, "missing_required_parameter", "custom_id"),
        (13, None, "invalid_json_line", None),
    ]
    assert parse_lines(b"\n  \n") == []
    assert "line 1" in errors[8].message and "/v1/embeddings" in errors[6].message


def test_output_lines_have_openais_batch_shape():
    ok = json.loads(dump_line(result_line("x", 200, "cmpl-1", {"id": "cmpl-1", "text": "é"})))
    assert ok["id"].startswith("batch_req_") and ok["custom_id"] == "x" and ok["error"] is None
    assert ok["response"] == {"status_code": 200, "request_id": "cmpl-1", "body": {"id": "cmpl-1", "text": "é"}}
    assert "é" in dump_line(result_line("x", 200, "r", {"text": "é"}))  # text, not \\u escapes
    bad = json.loads(dump_line(error_line(LineError(3, "y", "invalid_url", "no", "url"))))
    assert bad["response"] is None and bad["custom_id"] == "y"
    assert bad["error"] == {"code": "invalid_url", "message": "no", "param": "url", "line": 3}


def test_lora_modules_take_vllms_two_forms():
    assert parse_lora_module("sql=/a/b=c") == LoraModule("sql", "/a/b=c")
    assert parse_lora_module('{"name": "sql", "path": "/a", "base_model_name": "m"}') == LoraModule("sql", "/a")
    for bad in ("sql", "=/a", "sql=", '{"name": "sql"}', "{oops"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_module(bad)


def test_a_module_named_as_the_base_model_is_said_once():
    from loraplex.server.batch_adapters import BatchAdapters

    # batch_setup puts "--lora-modules: " before it (the flag was named twice)
    with pytest.raises(ValueError) as caught:
        BatchAdapters.load([LoraModule("base", "/a")], None, 8, "base")
    assert str(caught.value) == "'base' is the base model's name"
