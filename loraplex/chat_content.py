"""A chat message's ``content`` in the shape its chat template takes, as vLLM hands it over.

OpenAI's ``content`` is a string or a list of parts (``[{"type": "text", "text": "a"}, ...]``);
only text parts are served. Which shape the template gets is the content format
(template_content_format.py), and within it vLLM's rules (vllm/entrypoints/chat_utils.py,
``_parse_chat_message_content`` and ``_parse_chat_message_content_parts``):

- ``"string"``: the parts' texts joined with a newline (``"\\n".join``); a string stays itself.
- ``"openai"``: a list of ``{"type": "text", "text": ...}`` parts; a string becomes one such
  part (vLLM wraps string content into a text part before parsing).
- content left out (an assistant turn of only tool calls or reasoning): ``""`` / ``[]``.
- a ``tool`` message is always a string, its text parts joined with a newline, in both formats
  (vLLM normalises tool results to text, as most templates only take a string there).
"""

from __future__ import annotations

from loraplex.sampling_params import InvalidRequestError
from loraplex.template_content_format import ContentFormat

TEXT_PART_SEPARATOR = "\n"  # vLLM's: "\n".join(texts) in the string format


def text_part(text: str) -> dict:
    """One OpenAI text part."""
    return {"type": "text", "text": text}


def part_texts(parts: list, where: str = "content") -> list[str]:
    """The texts of a list of content parts; any part that is not a text part (``image_url`` ...)
    is an ``InvalidRequestError`` naming ``where``."""
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"`{where}` parts must be text parts ({{\"type\": \"text\", \"text\": ...}})",
                                      param=where)
        texts.append(part["text"])
    return texts


def shape_content(role: str, content, fmt: ContentFormat):
    """``content`` (a string, a list of text parts, or None) as a ``role`` message's content in
    the format ``fmt``."""
    if content is None:
        texts = []
    elif isinstance(content, str):
        texts = [content]
    else:
        texts = part_texts(content)
    if fmt == "string" or role == "tool":
        return TEXT_PART_SEPARATOR.join(texts)
    return [text_part(t) for t in texts]


def shape_messages(messages: list[dict], fmt: ContentFormat) -> list[dict]:
    """Copies of the messages with their content in the format ``fmt``; everything else (tool
    calls, reasoning, names) as it was."""
    return [{**m, "content": shape_content(m.get("role", ""), m.get("content"), fmt)} for m in messages]


def check_messages(messages: list[dict], where: str = "messages") -> None:
    """Each message is an object whose content is a string, a list of text parts, or left out
    (vLLM reads that as no parts); anything else is an ``InvalidRequestError`` naming it."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequestError(f"`{where}[{i}]` must be a message object", param=f"{where}[{i}]")
        content, at = m.get("content"), f"{where}[{i}].content"
        if isinstance(content, list):
            part_texts(content, at)
        elif content is not None and not isinstance(content, str):
            raise InvalidRequestError(f"`{at}` must be a string or a list of text parts", param=at)
