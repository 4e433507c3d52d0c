"""A chat request's ``messages``: roles, text content, earlier turns' tool calls and reasoning,
tool results; what the chat template is given (chat_content.py renders the content)."""

from __future__ import annotations

from loraplex.chat_content import text_part
from loraplex.server.chat_output import REASONING_FIELDS
from loraplex.server.errors import bad_request
from loraplex.server.tool_calls import template_tool_calls

CHAT_ROLES = ("system", "user", "assistant", "tool")


def parse_messages(body) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"`{where}` must be an object", param=where)
        role = m.get("role")
        if role == "developer":  # OpenAI's newer name for system
            role = "system"
        if role not in CHAT_ROLES:
            raise bad_request(f"`{where}.role` must be one of {', '.join(CHAT_ROLES)}", param=f"{where}.role")
        msg: dict = {"role": role}
        calls = m.get("tool_calls") if role == "assistant" else None
        reasoning = _reasoning(m, where) if role == "assistant" else None
        if (calls or reasoning is not None) and m.get("content") is None:
            # an earlier turn of only tool calls or reasoning: null content (chat_output.py), "" or [] rendered
            msg["content"] = None
        else:
            msg["content"] = _content(m.get("content"), f"{where}.content")
        if calls:
            msg["tool_calls"] = template_tool_calls(calls, f"{where}.tool_calls")
        if reasoning is not None:  # under both names, as vLLM hands it to the template (vllm-project/vllm#33635)
            msg["reasoning"] = msg["reasoning_content"] = reasoning
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(f"`{where}.tool_call_id` must be a non-empty string (the id of the call answered)",
                                  param=f"{where}.tool_call_id")
            msg["tool_call_id"] = call_id
        if isinstance(m.get("name"), str):  # vLLM passes a message's name on to the template
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _reasoning(m: dict, where: str) -> str | None:
    """An earlier assistant turn's reasoning, as the response gave it (reasoning_parsers.py):
    ``reasoning`` (vLLM's name since vllm-project/vllm#27752) or ``reasoning_content`` (the older
    name, which Qwen3's template reads, and what DeepSeek's API and the Vercel AI SDK send back).
    Either is taken (vLLM reads only ``reasoning``, vllm-project/vllm#38488); both with different
    text is a 400 rather than one of them lost."""
    values = {}
    for key in REASONING_FIELDS:  # the names an answer gives it under
        value = m.get(key)
        if value is not None and not isinstance(value, str):
            raise bad_request(f"`{where}.{key}` must be a string or null, got {type(value).__name__}",
                              param=f"{where}.{key}")
        if value is not None:
            values[key] = value
    if len(set(values.values())) > 1:
        raise bad_request(f"`{where}.reasoning` and `{where}.reasoning_content` are two names for the same text; "
                          "they differ here (send one, or both the same)", param=f"{where}.reasoning_content")
    return next(iter(values.values()), None)


# the parts that are text, and the key holding it: OpenAI's ``text``, the Responses API's
# ``input_text`` / ``output_text`` (sent back as chat history), and an earlier answer's
# ``refusal`` (the SDK's assistant message type has it): vLLM's chat parser takes all four as text
TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def _content(content, where: str) -> str | list[dict]:
    """A string as sent, or the text parts as ``{"type": "text", "text"}`` (only text parts are
    served, ``TEXT_PART_KEYS``); the chat template gets them in its content format when the
    prompt is rendered (loraplex/chat_content.py)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            key = TEXT_PART_KEYS.get(part.get("type")) if isinstance(part, dict) else None
            if key is None or not isinstance(part.get(key), str):
                raise bad_request(f"`{where}` parts must be text parts", param=where)
            texts.append(part[key])
        return [text_part(t) for t in texts]
    raise bad_request(f"`{where}` must be a string or a list of text parts", param=where)
