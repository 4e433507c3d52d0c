"""OpenAI's Responses API shapes: the ``response`` object, its output items, and the stream's
semantic events, built from what the chat path produces (a chat message, or the chat stream's
chunks), so both answers come from the same parsers.

Output items, in order: a ``reasoning`` item (``content: [{"type": "reasoning_text"}]``, empty
``summary``) when the server's ``--reasoning-parser`` split reasoning off; a ``message`` item
with one ``output_text`` part; one ``function_call`` item per tool call (``call_id`` is the chat
tool call's id, ``id`` an ``fc_`` id of its own). A message item is left out when the answer is
only tool calls (with nothing but whitespace around them) or only reasoning, as chat's
``content`` is then null. Text a model writes after or between its ``"auto"`` calls is a
message item of its own where it came (``replay_items``), as the stream gives it. Finishing on ``max_output_tokens`` makes the response ``incomplete``
(``incomplete_details.reason: "max_output_tokens"``) and its last item ``incomplete``.

With ``include: ["message.output_text.logprobs"]`` the chat path's logprobs entries ride along:
the whole answer's on its first ``output_text`` part (``add_logprobs``), a stream's on the
``response.output_text.delta`` of the text they came with (tokens that wrote no text yet wait
for the next delta, or come on an empty one), and the done events carry the message's whole list.

A stream (``EventStream``) opens an item when its first text comes and closes it when another
kind begins or the answer ends, so its events in order rebuild the same items; the text of a
message is held back while it is only whitespace, which the whole answer drops next to tool
calls.
"""

from __future__ import annotations

import json
import uuid

INCOMPLETE = {"reason": "max_output_tokens"}


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage: ``cached_tokens``, the input tokens the prefix cache served (always, as
    OpenAI and vLLM's Responses API report it); cache writes and reasoning tokens are not
    counted here (0)."""
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def response_object(response_id: str, created: int, model: str, echo: dict, status: str, output: list[dict],
                     usage_: dict | None, error: dict | None = None) -> dict:
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status,
        "background": False, "error": error,
        "incomplete_details": INCOMPLETE if status == "incomplete" else None,
        "model": model, "output": output, "previous_response_id": None, "reasoning": None,
        "truncation": "disabled", "top_logprobs": 0, "usage": usage_, **echo,
    }


def message_item(text: str, status: str, item_id: str | None = None) -> dict:
    return {"id": item_id or new_item_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)]}


def text_part(text: str, logprobs: list[dict] | None = None) -> dict:
    """An ``output_text`` part; ``logprobs``: chat's ``logprobs.content`` entries of its tokens."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs or [])}


def delta_logprobs(entries: list[dict]) -> list[dict]:
    """Chat's logprobs entries as a ``response.output_text.delta`` event carries them: OpenAI's
    delta ``Logprob`` type (token, logprob, top_logprobs of token and logprob), no ``bytes`` (as vLLM)."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e.get("top_logprobs") or []]}
            for e in entries]


def add_logprobs(items: list[dict], entries: list[dict]) -> None:
    """The whole answer's logprobs (chat's ``logprobs.content``) on its first message's part:
    all the output's tokens, as vLLM's ``_make_response_output_items`` puts them (with a
    reasoning or tool-call parser, the tokens of the text it moved elsewhere too)."""
    for item in items:
        if item["type"] == "message":
            item["content"][0]["logprobs"] = list(entries)
            return


def reasoning_item(text: str, status: str, item_id: str | None = None) -> dict:
    return {"id": item_id or new_item_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def call_item(call_id: str, name: str, arguments: str, status: str, item_id: str | None = None) -> dict:
    return {"id": item_id or new_item_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(message: dict, finish_reason: str | None) -> list[dict]:
    """A chat message (chat_output.py / tool_calls.py) as output items."""
    items = []
    reasoning = message.get("reasoning")
    if reasoning:
        items.append(reasoning_item(reasoning, "completed"))
    content = message.get("content")
    calls = message.get("tool_calls") or []
    if content or (not calls and not reasoning):
        items.append(message_item(content or "", "completed"))
    for call in calls:
        items.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"], "completed"))
    if finish_reason == "length":
        items[-1]["status"] = "incomplete"
    return items


def replay_items(reader, text: str, finish_reason: str | None) -> list[dict]:
    """The output items of a whole text read by ``reader`` (a chat_output.ChoiceOutput): its
    deltas fed to an ``EventStream`` as a stream's chunks would be, so the items are the ones a
    stream of the same output makes."""
    stream = EventStream("", 0, "", {})
    for delta in reader.feed(text) + reader.finish():
        stream.feed({"choices": [{"delta": delta, "finish_reason": None}]})
    stream.finish_reason = finish_reason
    stream.finish(0, 0)
    return stream.items


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class EventStream:
    """The semantic events of one streamed response, fed the chat stream's chunks (one choice);
    every event carries the next ``sequence_number``."""

    def __init__(self, response_id: str, created: int, model: str, echo: dict):
        self.response_id = response_id
        self.model = model
        self.echo = echo
        self.created = created
        self.items: list[dict] = []  # closed items, in output order
        self._open: dict | None = None  # the item being streamed
        self._text: list[str] = []  # the open item's text (message, reasoning) or arguments (call), in pieces
        self._held: list[str] = []  # message text that is so far only whitespace, in pieces
        self._logprobs: list[dict] = []  # the open message's logprobs entries (chat's), in order
        self._held_logprobs: list[dict] = []  # entries that came before their message opened
        self._seq = 0
        self.finish_reason: str | None = None

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _response(self, status: str, usage_: dict | None = None, error: dict | None = None) -> dict:
        return response_object(self.response_id, self.created, self.model, self.echo, status, list(self.items),
                               usage_, error)

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self._response("in_progress")),
                self._event("response.in_progress", response=self._response("in_progress"))]

    # --- the chat stream's chunks -------------------------------------------------------------

    def feed(self, chunk: dict) -> list[dict]:
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        logprobs = (choice.get("logprobs") or {}).get("content") or []  # only with include's logprobs
        out: list[dict] = []
        if delta.get("reasoning"):
            out += self._append("reasoning", delta["reasoning"])
        if delta.get("content"):
            out += self._content(delta["content"], logprobs)
        elif logprobs and not delta.get("reasoning") and not delta.get("tool_calls"):
            # tokens that wrote no text yet (a held-back character, the end token): the message's
            if self._open is not None and self._open["type"] == "message":
                out += self._append("message", "", logprobs)
            else:
                self._held_logprobs += logprobs
        for entry in delta.get("tool_calls") or []:
            if "id" in entry:
                out += self._open_item(call_item(entry["id"], entry["function"]["name"], "", "in_progress"))
            if entry["function"].get("arguments"):
                out += self._append("function_call", entry["function"]["arguments"])
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        return out

    def _content(self, text: str, logprobs: list[dict]) -> list[dict]:
        if self._open is not None and self._open["type"] == "message":
            return self._append("message", text, logprobs)
        self._held.append(text)
        self._held_logprobs += logprobs
        if not text.strip():
            return []
        held, self._held = "".join(self._held), []
        return self._open_item(message_item("", "in_progress")) + self._append("message", held, self._take_held())

    def _take_held(self) -> list[dict]:
        held, self._held_logprobs = self._held_logprobs, []
        return held

    def _open_item(self, item: dict) -> list[dict]:
        out = self._close("completed")
        self._open, self._text, self._logprobs = item, [], []
        index = len(self.items)
        out.append(self._event("response.output_item.added", output_index=index, item=json.loads(json.dumps(item))))
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part=text_part("")))
        elif item["type"] == "reasoning":
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part={"type": "reasoning_text", "text": ""}))
        return out

    def _append(self, kind: str, text: str, logprobs: list[dict] = ()) -> list[dict]:
        out = []
        if kind == "reasoning" and (self._open is None or self._open["type"] != "reasoning"):
            out += self._open_item(reasoning_item("", "in_progress"))  # messages and calls open elsewhere
        self._text.append(text)
        where = {"item_id": self._open["id"], "output_index": len(self.items)}
        if kind == "message":
            self._logprobs += logprobs
            out.append(self._event("response.output_text.delta", **where, content_index=0, delta=text,
                                   logprobs=delta_logprobs(logprobs)))
        elif kind == "reasoning":
            out.append(self._event("response.reasoning_text.delta", **where, content_index=0, delta=text))
        else:
            out.append(self._event("response.function_call_arguments.delta", **where, delta=text))
        return out

    def _close(self, status: str) -> list[dict]:
        item = self._open
        if item is None:
            return []
        self._open = None
        text = "".join(self._text)
        where = {"item_id": item["id"], "output_index": len(self.items)}
        out = []
        if item["type"] == "message":
            out.append(self._event("response.output_text.done", **where, content_index=0, text=text,
                                   logprobs=list(self._logprobs)))
            item["content"] = [text_part(text, self._logprobs)]
            out.append(self._event("response.content_part.done", **where, content_index=0,
                                   part=text_part(text, self._logprobs)))
        elif item["type"] == "reasoning":
            out.append(self._event("response.reasoning_text.done", **where, content_index=0, text=text))
            item["content"] = [{"type": "reasoning_text", "text": text}]
            out.append(self._event("response.content_part.done", **where, content_index=0, part=item["content"][0]))
        else:
            item["arguments"] = text
            out.append(self._event("response.function_call_arguments.done", **where, name=item["name"],
                                   arguments=text))
        item["status"] = status
        out.append(self._event("response.output_item.done", output_index=where["output_index"], item=item))
        self.items.append(item)
        return out

    # --- the end --------------------------------------------------------------------------------

    def finish(self, input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> list[dict]:
        """Closes the last item and ends with ``response.completed`` (or ``response.incomplete``)."""
        out: list[dict] = []
        has_message = any(it["type"] == "message" for it in self.items) or (
            self._open is not None and self._open["type"] == "message")
        has_call = any(it["type"] == "function_call" for it in self.items) or (
            self._open is not None and self._open["type"] == "function_call")
        has_reasoning = any(it["type"] == "reasoning" for it in self.items) or (
            self._open is not None and self._open["type"] == "reasoning")
        if not has_message and not has_call and (self._held or not has_reasoning):
            out += self._open_item(message_item("", "in_progress"))  # whitespace, or an empty answer
            if self._held or self._held_logprobs:
                out += self._append("message", "".join(self._held), self._take_held())
        self._held, self._held_logprobs = [], []
        status = status_of(self.finish_reason)
        out += self._close(status)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        totals = usage(input_tokens, output_tokens, cached_tokens)
        out.append(self._event(kind, response=self._response(status, totals)))
        return out

    def failed(self, message: str) -> list[dict]:
        """An engine failure after the stream began: ``response.failed``, with what was made."""
        out = self._close("incomplete")
        error = {"code": "server_error", "message": message}
        return out + [self._event("response.failed", response=self._response("failed", error=error))]


def sse(event: dict) -> bytes:
    """One event as SSE: its type on the ``event:`` line, the whole event as ``data:``."""
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode("utf-8")
