"""The request fields that ask for structured output, read into one ``StructuredOutputs``.

OpenAI's ``response_format`` (``{"type": "json_object"}``, or ``{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}``), vLLM's ``structured_outputs`` object (``json``,
``json_object``, ``regex``, ``choice``, ``grammar``) and its older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``. At most one may ask for a constraint
(``structured_outputs.disable_any_whitespace`` applies to whichever does);
the schema, regex or grammar is checked here, so a bad one is a 400 naming its field before any
model work.

``checked_constraint`` is the one way the server builds a constraint from request fields (these,
LoRAX's in tgi_protocol.py, a tool choice's in tool_calls.py): a bad one is a 400 naming the
field that sent it.
"""

from __future__ import annotations

from loraplex.sampling_params import InvalidRequestError
from loraplex.server.errors import bad_request
from loraplex.structured_output import KINDS, StructuredOutputs

# vLLM's older fields, one per kind but json_object: guided_json, guided_regex, ...
GUIDED_FIELDS = {f"guided_{kind}": kind for kind in KINDS if kind != "json_object"}
# the fields that can ask for a constraint, in the order the one-per-request error names them
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", *GUIDED_FIELDS)
# vLLM's structured_outputs keys that ask for a constraint loraplex does not build
UNSERVED_STRUCTURED_OUTPUTS = ("structural_tag",)


def checked_constraint(param: str, **spec) -> StructuredOutputs:
    """``StructuredOutputs(**spec)``, checked with llguidance; a 400 naming ``param`` when it is
    not one (or not one llguidance can enforce)."""
    try:
        constraint = StructuredOutputs(**spec)
        constraint.check(param=param)
    except InvalidRequestError as exc:
        raise bad_request(exc.message, param=param) from None
    return constraint


def _from_response_format(value) -> dict | None:
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request(
            '`response_format` must be {"type": "text"}, {"type": "json_object"} or '
            '{"type": "json_schema", "json_schema": {...}}',
            param="response_format",
        )
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return {"json_object": True}
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("`response_format.json_schema` must be an object", param="response_format.json_schema")
    schema = spec.get("schema")
    if schema is None:  # OpenAI lets the schema out: any JSON object then
        return {"json_object": True}
    if not isinstance(schema, dict):
        raise bad_request("`response_format.json_schema.schema` must be an object", param="response_format.json_schema.schema")
    return {"json": schema}


def _from_structured_outputs(value) -> dict | None:
    if not isinstance(value, dict):
        raise bad_request("`structured_outputs` must be an object", param="structured_outputs")
    for name in UNSERVED_STRUCTURED_OUTPUTS:  # vLLM's, not served: unconstrained text would be a silent change
        if value.get(name) not in (None, "", {}):
            raise bad_request(f"`structured_outputs.{name}` is not supported", param=f"structured_outputs.{name}",
                              code="unsupported_parameter")
    given = {k: value[k] for k in KINDS if value.get(k) not in (None, False)}
    return given or None


def parse_structured_output(body: dict) -> StructuredOutputs | None:
    """The request's constraint, checked; None when it asks for none."""
    # vLLM's structured_outputs.disable_any_whitespace, whichever field gives the constraint:
    # read first, so the grammar checked here is the one the engine compiles
    options = body.get("structured_outputs")
    compact = options.get("disable_any_whitespace") if isinstance(options, dict) else None
    if compact is not None and not isinstance(compact, bool):
        raise bad_request("`structured_outputs.disable_any_whitespace` must be a boolean",
                          param="structured_outputs.disable_any_whitespace")
    found: list[tuple[str, StructuredOutputs]] = []
    for field in CONSTRAINT_FIELDS:
        value = body.get(field)
        if value is None:
            continue
        if field == "response_format":
            spec = _from_response_format(value)
        elif field == "structured_outputs":
            spec = _from_structured_outputs(value)
        else:
            spec = {GUIDED_FIELDS[field]: value}
        if spec is not None:
            found.append((field, checked_constraint(field, **spec, disable_any_whitespace=bool(compact))))
    if len(found) > 1:
        raise bad_request(
            f"`{found[1][0]}`: one structured output constraint per request (`{found[0][0]}` gives one already)",
            param=found[1][0],
        )
    return found[0][1] if found else None
