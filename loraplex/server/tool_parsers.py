"""Tool-call parsers for ``tool_choice: "auto"``: the model writes freely, and the server reads
its own tool-call syntax out of the text, as vLLM does with ``--enable-auto-tool-choice
--tool-call-parser NAME``. Chosen once per server with ``--tool-call-parser`` (vLLM's names):

- ``hermes`` (Qwen2.5, Qwen3, Hermes 2 Pro / 3): each call is ``<tool_call>\\n{"name": ...,
  "arguments": {...}}\\n</tool_call>``; text may come before, between and after calls. The last
  call may lack its ``</tool_call>`` (the output ended first), as vLLM's parser allows.
- ``llama3_json`` (alias ``llama4_json``; Llama 3.1/3.2 JSON tool calling): the output is
  ``{"name": ..., "parameters": {...}}`` objects (``"arguments"`` taken too), optionally led by
  ``<|python_tag|>``, several separated by ``;``. Only an output that starts (after whitespace)
  with ``{`` or the tag is read as calls, as vLLM's streaming parser does; vLLM's whole-output
  parser also picks JSON objects out of the middle of prose, which would make every answer that
  quotes JSON a failed call.

Rules shared by both, where vLLM decides them:
- A call that does not parse (not JSON, no string ``name``, no arguments key) makes the whole
  output plain ``content`` with no ``tool_calls`` (vLLM logs the error and answers the same).
  Tool names are not checked against ``tools`` (nor does vLLM check them).
- ``arguments`` is the model's own text of the value, not re-serialised (vLLM's whole-output
  parsers re-serialise it with ``json.dumps``; both parse to the same JSON), so the streamed
  pieces of a call join into exactly the ``arguments`` of the same output answered whole.
- ``content`` is the text outside the calls (vLLM keeps only the text before the first call),
  ``null`` when that is only whitespace (a model's newlines around its calls), as OpenAI
  answers next to ``tool_calls``.

Streaming (``ToolCallStreamer``): text streams as content until a call's start marker could be
beginning (a possible partial marker is held back, and released when it is not one). A call is
announced (index, id, name) as soon as its name is complete; its arguments stream from there.
Text after a start marker is held until the call is announced; should the output end without
any call announced, the held text is sent as content, so the stream joins into the same answer.
A call announced and then found broken (its JSON cut short by ``max_tokens``, say) cannot be
taken back: the stream keeps it, where the whole-output answer turns into content (vLLM's
streams do the same).
"""

from __future__ import annotations

from loraplex.server.call_reader import CallObjectReader

_WS = " \t\n\r"


def partial_marker_len(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (shorter than it)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolCallParser:
    """A model's tool-call syntax. ``scanner()`` makes the per-output reader: ``feed(text)`` and
    ``finish()`` return events ``("text", s)`` (outside calls), ``("start",)`` (a call region
    begins), ``("call", name)`` and ``("args", piece)``; ``valid`` turns false on a region that
    is no call."""

    name = ""
    keep_special_tokens = False  # the call markers are special tokens in some of its models

    def scanner(self):
        raise NotImplementedError


class _Scanner:
    def __init__(self) -> None:
        self.buf = ""
        self.state = "text"
        self.reader: CallObjectReader | None = None
        self.valid = True

    def feed(self, text: str) -> list[tuple]:
        self.buf += text
        return self._run(False)

    def finish(self) -> list[tuple]:
        return self._run(True)

    def _object(self, out: list, final: bool, args_keys: tuple[str, ...]) -> bool:
        """Feeds the call object; True once it is complete (and checked)."""
        if self.reader is None:
            self.reader = CallObjectReader(args_keys)
        out.extend(self.reader.feed(self.buf))
        self.buf = self.buf[self.reader.consumed:]
        if not self.reader.done:
            if final:
                self.valid = False
            return False
        self.valid = self.valid and self.reader.check()
        self.reader = None
        return True

    def _run(self, final: bool) -> list[tuple]:
        raise NotImplementedError


class _HermesScanner(_Scanner):
    START, END = "<tool_call>", "</tool_call>"

    def _run(self, final: bool) -> list[tuple]:
        out: list[tuple] = []
        while True:
            if self.state == "text":
                i = self.buf.find(self.START)
                if i >= 0:
                    if i:
                        out.append(("text", self.buf[:i]))
                    out.append(("start",))
                    self.buf, self.state = self.buf[i + len(self.START):], "open"
                    continue
                keep = 0 if final else partial_marker_len(self.buf, self.START)
                if len(self.buf) > keep:
                    out.append(("text", self.buf[:len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep:]
                return out
            if self.state == "open":  # whitespace, then the call's object
                self.buf = self.buf.lstrip(_WS)
                if not self.buf:
                    self.valid = self.valid and not final
                    return out
                self.state = "object" if self.buf[0] == "{" else "skip"
                self.valid = self.valid and self.state == "object"
                continue
            if self.state == "object":
                if not self._object(out, final, ("arguments",)):
                    return out
                self.state = "close"
                continue
            if self.state == "close":  # whitespace, then </tool_call> (or the end of the output)
                self.buf = self.buf.lstrip(_WS)
                if self.buf.startswith(self.END):
                    self.buf, self.state = self.buf[len(self.END):], "text"
                    continue
                if not self.buf or (self.END.startswith(self.buf) and not final):
                    return out
                self.valid, self.state = False, "skip"
                continue
            # "skip": a region that is no call, up to its </tool_call>
            i = self.buf.find(self.END)
            if i >= 0:
                self.buf, self.state = self.buf[i + len(self.END):], "text"
                continue
            self.buf = self.buf[len(self.buf) - partial_marker_len(self.buf, self.END):]
            return out


class _Llama3JsonScanner(_Scanner):
    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self.state = "lead"
        self._lead: list[str] = []  # leading whitespace set aside (kept in buf, each piece rescans it)

    def _run(self, final: bool) -> list[tuple]:
        out: list[tuple] = []
        while True:
            if self.state == "lead":  # calls only when the output starts with one
                rest = self.buf.lstrip(_WS)
                if not rest and not final:
                    self._lead.append(self.buf)
                    self.buf = ""
                    return out
                lead = "".join(self._lead) + self.buf[:len(self.buf) - len(rest)]
                if rest.startswith(self.TAG) or rest.startswith("{"):
                    if lead:
                        out.append(("text", lead))
                    out.append(("start",))
                    self.buf = rest[len(self.TAG):] if rest.startswith(self.TAG) else rest
                    self.state, self._lead = "between", []
                    continue
                if not final and self.TAG.startswith(rest):
                    return out
                self.buf, self._lead = lead + rest, []
                self.state = "text"
                continue
            if self.state == "text":
                if self.buf:
                    out.append(("text", self.buf))
                self.buf = ""
                return out
            if self.state == "between":  # whitespace and one ";" between calls
                self.buf = self.buf.lstrip(_WS)
                if self.buf.startswith(";"):
                    self.buf = self.buf[1:]
                    continue
                if not self.buf:
                    return out
                self.state = "object" if self.buf[0] == "{" else "text"  # text after the calls: content
                continue
            if not self._object(out, final, ("arguments", "parameters")):
                return out
            self.state = "between"


class HermesParser(ToolCallParser):
    """``<tool_call>{"name", "arguments"}</tool_call>`` (Qwen2.5, Qwen3, Hermes)."""

    name = "hermes"
    keep_special_tokens = True  # as vLLM: Hermes models make <tool_call> a special token

    def scanner(self):
        return _HermesScanner()


class Llama3JsonParser(ToolCallParser):
    """``{"name", "parameters"}`` objects separated by ``;`` (Llama 3.1/3.2 JSON tool calling)."""

    name = "llama3_json"

    def scanner(self):
        return _Llama3JsonScanner()


TOOL_PARSERS: dict[str, ToolCallParser] = {
    "hermes": HermesParser(),
    "llama3_json": Llama3JsonParser(),
    "llama4_json": Llama3JsonParser(),  # vLLM's second name for the same parser
}


def get_tool_parser(name: str | None) -> ToolCallParser | None:
    """The parser of that name (None for None); an unknown name is a ValueError listing them."""
    if name is None:
        return None
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown --tool-call-parser {name!r}; known: {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]


class ToolCallStreamer:
    """One output read by a parser, as it arrives: ``feed``/``finish`` return ``("content", s)``,
    ``("call", index, name)`` and ``("args", index, piece)`` (see the module's docstring for
    what is held back). ``calls`` holds ``[name, arguments]`` per announced call; ``valid``
    whether every call region parsed."""

    def __init__(self, parser: ToolCallParser):
        self._scan = parser.scanner()
        # the output and each call's arguments as pieces (a str grown by ``+=`` is copied whole
        # each time: quadratic in a long output)
        self._text: list[str] = []
        self._length = 0
        self._calls: list[tuple[str, list[str]]] = []
        self._pending: list[str] = []  # text outside calls not sent yet
        self._pending_text = False  # whether it holds more than whitespace
        self._released = False
        self._sent = 0  # characters of ``text`` sent as content before any call region
        self._started = False

    @property
    def valid(self) -> bool:
        return self._scan.valid

    @property
    def calls(self) -> list[list[str]]:
        return [[name, "".join(args)] for name, args in self._calls]

    @property
    def has_calls(self) -> bool:
        return bool(self._calls)

    def feed(self, text: str) -> list[tuple]:
        self._text.append(text)
        self._length += len(text)
        return self._handle(self._scan.feed(text))

    def finish(self) -> list[tuple]:
        out = self._handle(self._scan.finish())
        if not self._calls and self._length > self._sent:  # no call: the output is content
            out.append(("content", "".join(self._text)[self._sent:]))
            self._sent, self._pending, self._pending_text = self._length, [], False
        return out

    def _handle(self, events: list[tuple]) -> list[tuple]:
        out = []
        for ev in events:
            if ev[0] == "text":
                self._pending.append(ev[1])
                self._pending_text = self._pending_text or bool(ev[1].strip(_WS))
                holding = self._started and not self._calls
                if not holding and (self._released or self._pending_text):
                    text = "".join(self._pending)
                    out.append(("content", text))
                    if not self._started:
                        self._sent += len(text)
                    self._pending, self._pending_text, self._released = [], False, True
            elif ev[0] == "start":
                self._started = True
            elif ev[0] == "call":
                self._calls.append((ev[1], []))
                out.append(("call", len(self._calls) - 1, ev[1]))
            elif self._calls:  # "args" (none come before a name)
                self._calls[-1][1].append(ev[1])
                out.append(("args", len(self._calls) - 1, ev[1]))
        return out
