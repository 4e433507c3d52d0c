"""Structured output fields (OpenAI's response_format, vLLM's structured_outputs and guided_*):
read into the engine's StructuredOutputs; a bad schema, regex or grammar, or two constraints at
once, is a 400 naming the field before anything reaches the engine."""

from __future__ import annotations

import pytest

from loraplex.structured_output import StructuredOutputs
from tests.server.test_errors_fake import _envelope
from tests.server.test_refused_fake import ENDPOINTS

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def client(module_server):
    key = module_server.make_tenant("structured")
    with module_server.tenant_client(key) as c:
        yield module_server, c


ACCEPTED = [
    ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredOutputs(json=SCHEMA)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, StructuredOutputs(json_object=True)),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": SCHEMA}, StructuredOutputs(json=SCHEMA)),
    ({"guided_regex": "[a-z]+"}, StructuredOutputs(regex="[a-z]+")),
    ({"guided_choice": ["yes", "no"]}, StructuredOutputs(choice=["yes", "no"])),
    ({"guided_grammar": 'start: "a" | "b"'}, StructuredOutputs(grammar='start: "a" | "b"')),
    ({"structured_outputs": {"choice": ["a", "b"], "json_object": False}}, StructuredOutputs(choice=["a", "b"])),
    ({"structured_outputs": {}}, None),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"disable_any_whitespace": True}},
     StructuredOutputs(json_object=True, disable_any_whitespace=True)),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     StructuredOutputs(json=SCHEMA, disable_any_whitespace=True)),
    ({"structured_outputs": {"disable_any_whitespace": True}}, None),
]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("patch,expected", ACCEPTED)
def test_constraint_reaches_the_engine(client, kind, patch, expected):
    srv, c = client
    path, body = ENDPOINTS[kind]
    r = c.post(path, json={**body, **patch})
    assert r.status_code == 200, r.text
    assert srv.engine.params_seen[srv.engine.started[-1][0]].structured_outputs == expected


REFUSED = [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "response_format.json_schema.schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_json": "not json"}, "guided_json"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": "regex"}, "structured_outputs"),
    # vLLM's structural tags are not served: refused, not answered unconstrained
    ({"structured_outputs": {"structural_tag": '{"structures": [], "triggers": []}'}}, "structured_outputs.structural_tag"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_json": SCHEMA, "structured_outputs": {"disable_any_whitespace": "yes"}},
     "structured_outputs.disable_any_whitespace"),
]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("patch,param", REFUSED)
def test_bad_constraint_is_a_400_naming_its_field(client, kind, patch, param):
    srv, c = client
    path, body = ENDPOINTS[kind]
    before = len(srv.engine.started)
    for stream in (False, True):  # refused before a stream starts
        _envelope(c.post(path, json={**body, **patch, "stream": stream}), 400, param=param)
    assert len(srv.engine.started) == before


def test_a_bad_schema_is_refused_naming_each_field_that_sends_it(client):
    """check()'s verdicts are kept by constraint, not by field: the same bad schema sent again,
    through the same field or another, is refused each time naming the field that sent it."""
    srv, c = client
    path, body = ENDPOINTS["chat"]
    bad = {"type": "string", "minLength": 5, "maxLength": 2}  # llguidance: no string fits
    sends = [
        ({"guided_json": bad}, "guided_json"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}}, "response_format"),
        ({"structured_outputs": {"json": bad}}, "structured_outputs"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": bad}}],
          "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
        ({"guided_json": bad}, "guided_json"),
    ]
    before = len(srv.engine.started)
    messages = {_envelope(c.post(path, json={**body, **patch}), 400, param=param)["message"] for patch, param in sends}
    assert len(messages) == 1 and "invalid structured output" in messages.pop()
    assert len(srv.engine.started) == before
