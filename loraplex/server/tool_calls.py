"""Tool calls (OpenAI's ``tools`` / ``tool_choice``) where they can be exact without a
model-specific parser, as vLLM serves them without ``--enable-auto-tool-choice``.

- ``tool_choice: {"type": "function", "function": {"name": "f"}}`` (named): the output is kept
  to f's ``parameters`` schema (``{"type": "object"}`` when f has none) and is the arguments of
  one call to f.
- ``tool_choice: "required"``: the output is kept to a JSON array (at least one item) of
  ``{"name": <a tool's name>, "parameters": <that tool's schema>}`` (vLLM's schema, ``anyOf``
  over the tools, their ``$defs`` hoisted to the top; no other key in an item), one call per
  item.
- ``tool_choice: "none"``: no call; the tools are still shown to the model (vLLM >= 0.10 does the
  same unless started with ``--exclude-tools-when-tool-choice-none``).
- ``"auto"`` (also the default when ``tools`` are sent): read by the server's
  ``--tool-call-parser`` (tool_parsers.py, chat_output.py); a 400 without one, as in vLLM.

The tools go to the chat template (``apply_chat_template(..., tools=...)``), so a template that
knows tools shows them to the model.

A call's ``arguments`` are the generated JSON text itself (for "required", the text of the
item's ``parameters`` value), so the streamed fragments of a call join into exactly the
``arguments`` of the same request answered whole. finish_reason follows OpenAI (vLLM since
vllm-project/vllm#25054): ``"tool_calls"`` for "required", ``"stop"`` for a named choice;
``"length"`` stays ``"length"``.
"""

from __future__ import annotations

import copy
import json
import uuid
from dataclasses import dataclass, field

from loraplex.server.call_reader import CallArrayReader
from loraplex.server.errors import bad_request
from loraplex.server.structured_fields import checked_constraint
from loraplex.structured_output import StructuredOutputs

NAMED_USAGE = 'give {"type": "function", "function": {"name": "<one of the tools>"}}'
EMPTY_PARAMETERS = {"type": "object"}  # a tool without parameters takes any JSON object
REQUIRED_ARGS = ("parameters",)  # the arguments key of a "required" item (vLLM's)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolRequest:
    """The tool fields of one chat request, checked."""

    tools: list[dict] | None = None  # for the chat template; None when none were sent
    mode: str | None = None  # "named" | "required"; None: no tool call is asked for
    name: str | None = None  # the named tool
    auto: str | None = None  # "auto" asked for: the field that asked ("tool_choice", or "tools")
    parallel: bool = True  # OpenAI's parallel_tool_calls
    constraint: StructuredOutputs | None = None


# --- request fields ---------------------------------------------------------------------------


def _check_tools(raw) -> list[dict]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad_request("`tools` must be a list of function tools", param="tools")
    out, seen = [], set()
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(
                f'`{where}` must be {{"type": "function", "function": {{"name", "description", "parameters"}}}}',
                param="tools",
            )
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"`{where}.function` must be an object", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"`{where}.function.name` must be a non-empty string", param="tools")
        if name in seen:
            raise bad_request(f"`{where}.function.name`: two tools are named {name!r}", param="tools")
        seen.add(name)
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise bad_request(f"`{where}.function.description` must be a string", param="tools")
        parameters = fn.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(f"`{where}.function.parameters` must be a JSON schema (an object)", param="tools")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request(f"`{where}.function.strict` must be a boolean", param="tools")
        clean = {"name": name}
        if description is not None:
            clean["description"] = description
        if parameters is not None:
            clean["parameters"] = parameters
        out.append({"type": "function", "function": clean})
    return out


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or EMPTY_PARAMETERS


def required_schema(tools: list[dict], parallel: bool = True) -> dict:
    """vLLM's schema for ``tool_choice: "required"``: a non-empty array of
    ``{"name", "parameters"}`` objects, one ``anyOf`` branch per tool. Each tool's ``$defs``
    (and ``definitions``) move to the top, where its ``#/$defs/...`` references point. Unlike
    vLLM's, an item may hold no other key (``additionalProperties: false``): without it a
    model can go on with keys of its own after the two, until ``max_tokens`` cuts the array.
    ``parallel=False`` (OpenAI's ``parallel_tool_calls: false``) allows one item: vLLM drops
    the calls after the first, here the model is not let to write them."""
    branches, hoisted = [], {}
    for i, tool in enumerate(tools):
        params = copy.deepcopy(_parameters(tool))
        for keyword in ("$defs", "definitions"):
            defs = params.pop(keyword, None)
            if defs is None:
                continue
            if not isinstance(defs, dict):
                raise bad_request(f"`tools[{i}].function.parameters.{keyword}` must be an object", param="tools")
            bucket = hoisted.setdefault(keyword, {})
            for key, value in defs.items():
                if key in bucket and bucket[key] != value:
                    raise bad_request(
                        f"`tools[{i}].function.parameters.{keyword}.{key}` differs from another tool's "
                        "definition of the same name (they share one namespace under tool_choice \"required\")",
                        param="tools",
                    )
                bucket[key] = value
        branches.append({
            "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]}, "parameters": params},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    schema.update(hoisted)
    return schema


def parse_tools(body: dict) -> ToolRequest:
    """The request's tools and tool choice, checked; the constraint of a named or required
    choice is checked with llguidance here (a schema it cannot enforce is a 400 naming
    ``tools``). ``"auto"`` with tools is only marked (``auto``); chat_output.py reads it."""
    tools = _check_tools(body.get("tools"))
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("`parallel_tool_calls` must be a boolean", param="parallel_tool_calls")
    req = ToolRequest(tools=tools or None, parallel=parallel is not False)
    if choice is None or choice in ("none", "auto"):  # "auto" without tools asks for nothing
        req.auto = ("tool_choice" if choice else "tools") if tools and choice != "none" else None
        return req
    if choice == "required":
        if not tools:
            raise bad_request('`tool_choice` "required" needs a non-empty `tools` list', param="tool_choice")
        req.mode = "required"
        schema = required_schema(tools, parallel is not False)
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"`tool_choice` must be \"none\", \"required\" or a named function: {NAMED_USAGE}",
                              param="tool_choice")
        by_name = {t["function"]["name"]: t for t in tools}
        if fn["name"] not in by_name:
            raise bad_request(f"`tool_choice` names the tool {fn['name']!r}, which is not in `tools`",
                              param="tool_choice")
        req.mode, req.name = "named", fn["name"]
        schema = _parameters(by_name[fn["name"]])
    else:
        raise bad_request(f"`tool_choice` must be \"none\", \"auto\", \"required\" or a named function: {NAMED_USAGE}",
                          param="tool_choice")
    req.constraint = checked_constraint("tools", json=schema)
    return req


def template_tool_calls(raw, where: str) -> list[dict]:
    """An assistant message's ``tool_calls``, as chat templates take them: ``arguments`` as an
    object (vLLM parses the JSON text the same way; text that is not a JSON object becomes
    ``{}``, as in vLLM, so a call cut short by ``max_tokens`` does not make every later turn
    of the conversation fail)."""
    if not isinstance(raw, list):
        raise bad_request(f"`{where}` must be a list of tool calls", param=where)
    out = []
    for j, call in enumerate(raw):
        at = f"{where}[{j}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise bad_request(f'`{at}` must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}',
                              param=where)
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"`{at}.function.name` must be a non-empty string", param=where)
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad_request(f"`{at}.id` must be a string", param=where)
        arguments = fn.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (ValueError, RecursionError):  # nested deeper than json can read: not JSON here
                arguments = {}
        elif arguments is not None and not isinstance(arguments, dict):
            raise bad_request(f"`{at}.function.arguments` must be a string of JSON", param=where)
        if not isinstance(arguments, dict):
            arguments = {}
        entry = {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
        if call_id is not None:
            entry = {"id": call_id, **entry}
        out.append(entry)
    return out


# --- reading the output -----------------------------------------------------------------------


def required_calls(text: str) -> list[tuple[str, str]] | None:
    """The calls of a whole "required" output, ``[(name, arguments text)]``; None when the text
    is not a complete array of ``{"name", "parameters"}`` items (cut short by ``max_tokens``
    or a stop string)."""
    reader = CallArrayReader(REQUIRED_ARGS)
    reader.feed(text)
    if not reader.complete:
        return None
    # the reader keeps the model's own text; fall back to re-serialising should it ever disagree
    if all(call.check() for call in reader.calls):
        return [(call.name, call.arguments) for call in reader.calls]
    items = [call.value for call in reader.calls]
    return [(it["name"], json.dumps(it["parameters"], ensure_ascii=False)) for it in items]


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict:
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def finish_reason(mode: str, engine_reason: str | None, called: bool) -> str | None:
    """OpenAI's (and vLLM's since #25054): "tool_calls" when "required" made its calls and the
    model stopped by itself; a named choice keeps "stop"; "length" stays "length"."""
    if mode == "required" and called and engine_reason == "stop":
        return "tool_calls"
    return engine_reason


def message(req: ToolRequest, text: str) -> tuple[dict, bool]:
    """The assistant message of a whole output, and whether it holds tool calls. A "required"
    output that is not a complete array (cut short) is returned as content."""
    if req.mode == "named":
        return {"role": "assistant", "content": None, "tool_calls": [tool_call(req.name, text)]}, True
    calls = required_calls(text)
    if calls is None:
        return {"role": "assistant", "content": text}, False
    return {"role": "assistant", "content": None, "tool_calls": [tool_call(n, a) for n, a in calls]}, True


@dataclass
class ToolCallStream:
    """One choice's streamed tool calls: ``feed`` turns output text into ``tool_calls`` entries,
    each for a delta of its own: the first of a call carries ``index``, ``id``, ``type``, the
    name and ``arguments: ""``, later ones ``index`` and a piece of the arguments, as OpenAI
    streams them and its client accumulates them."""

    req: ToolRequest
    _reader: CallArrayReader = field(default_factory=lambda: CallArrayReader(REQUIRED_ARGS))
    _started: bool = False

    def start(self) -> list[dict]:
        """A named call is announced before its first argument."""
        if self.req.mode == "named" and not self._started:
            self._started = True
            return [_header(0, self.req.name)]
        return []

    def feed(self, text: str) -> list[dict]:
        if not text:
            return []
        if self.req.mode == "named":
            return [*self.start(), {"index": 0, "function": {"arguments": text}}]
        return [
            _header(index, value) if kind == "call" else {"index": index, "function": {"arguments": value}}
            for kind, index, value in self._reader.feed(text)
        ]

    def called(self) -> bool:
        """Whether the whole output made its calls (a "required" array complete); the reader
        keeps the answer as it goes, so asking costs nothing."""
        return self.req.mode == "named" or self._reader.complete


def _header(index: int, name: str) -> dict:
    return {"index": index, "id": new_call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
