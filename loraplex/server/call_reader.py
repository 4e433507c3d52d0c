"""Reads tool calls written as JSON as they arrive, character by character: one call object
(``{"name": ..., "arguments": {...}}``) for the model-specific parsers of ``tool_parsers.py``,
and an array of them (``[{"name": ..., "parameters": {...}}, ...]``) for ``tool_choice:
"required"`` (``tool_calls.py``), each of its items read as one call object.

A call's name is reported once its string is complete and then the text of its arguments value
(the model's own text, held back until the name is known should the arguments come first), so
the pieces of a streamed call join into exactly the ``arguments`` of the same output read whole.
The object reader is not a JSON validator: each object is parsed once, when it is complete.
"""

from __future__ import annotations

import json

_WS = " \t\n\r"  # JSON's whitespace


def _loads(text: str):
    """The JSON value of ``text``, None when it is none; a model's output nested deeper than
    the interpreter's recursion limit (RecursionError) is none either, not a server error."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


class CallObjectReader:
    """One call object. ``feed`` takes its characters from the opening ``{`` and returns the
    events of that piece: ``("call", name)`` once, then ``("args", text)`` pieces; ``done``
    turns true at the closing ``}`` (the rest of a fed piece is not consumed: ``feed`` returns
    how many characters it took as ``consumed``)."""

    def __init__(self, args_keys: tuple[str, ...]):
        self.args_keys = args_keys
        self.name: str | None = None
        # the text of the arguments value(s) read so far, as pieces: ``+=`` on a str attribute
        # copies it whole each time, quadratic in a model's (possibly enormous) arguments
        self._arguments: list[str] = []
        self.done = False
        self.value = None  # the complete object parsed (None until then, or when it is not JSON)
        self.consumed = 0
        self._raw: list[str] = []
        self._depth = 0
        self._in_str = self._esc = False
        self._slot = "key"  # at the object's level: "key" | "colon" | "value" | "in_value" | "after"
        self._key = None
        self._cap: list[str] | None = None  # a key, or the name's string, being read
        self._cap_is_key = False
        self._args: str | None = None  # None | "nested" | "string" | "scalar": reading arguments
        self._args_depth = 0
        self._held: list[str] = []  # arguments read before the name
        self._out: list[tuple] = []
        self._piece: list[str] = []  # arguments of this feed not yet in ``_out``

    @property
    def arguments(self) -> str:
        return "".join(self._arguments)

    def feed(self, text: str) -> list[tuple]:
        self._out, self.consumed = [], 0
        for ch in text:
            if self.done:
                break
            self.consumed += 1
            self._raw.append(ch)
            self._char(ch)
        self._flush()
        return self._out

    def _flush(self) -> None:
        if self._piece:
            self._out.append(("args", "".join(self._piece)))
            self._piece = []

    def check(self) -> bool:
        """Whether the complete object is a call: JSON, a string ``name``, exactly one of the
        arguments keys, and the read text agreeing with the parse."""
        if not self.done or self.name is None:
            return False
        obj = self.value
        keys = [k for k in self.args_keys if isinstance(obj, dict) and k in obj]
        if not isinstance(obj, dict) or obj.get("name") != self.name or len(keys) != 1:
            return False
        try:
            return json.loads(self.arguments) == obj[keys[0]]
        except (ValueError, RecursionError):
            return False

    # --- one character ------------------------------------------------------------------------

    def _arg(self, ch: str) -> None:
        self._arguments.append(ch)
        (self._held if self.name is None else self._piece).append(ch)

    def _end_args(self) -> None:
        self._args, self._slot = None, "after"

    def _end_capture(self) -> None:
        value = _loads("".join(self._cap))
        self._cap = None
        if self._cap_is_key:
            self._key, self._slot = value, "colon"
            return
        self._slot = "after"
        if isinstance(value, str) and self.name is None:
            self.name = value
            self._flush()
            self._out.append(("call", value))
            if self._held:
                self._out.append(("args", "".join(self._held)))
                self._held = []

    def _char(self, ch: str) -> None:
        if self._in_str:
            if self._args:
                self._arg(ch)
            if self._cap is not None:
                self._cap.append(ch)
            if self._esc:
                self._esc = False
            elif ch == "\\":
                self._esc = True
            elif ch == '"':
                self._in_str = False
                if self._cap is not None:
                    self._end_capture()
                elif self._args == "string":
                    self._end_args()
            return
        if self._args == "scalar":  # a number or literal ends at the first character not its own
            if ch in _WS or ch in ",}]":
                self._end_args()
            else:
                self._arg(ch)
                return
        at_top = self._depth == 1 and not self._args
        if ch == '"':
            self._in_str = True
            if self._args:
                self._arg(ch)
            elif at_top and self._slot == "key":
                self._cap, self._cap_is_key = ['"'], True
            elif at_top and self._slot == "value":
                self._slot = "in_value"
                if self._key == "name":
                    self._cap, self._cap_is_key = ['"'], False
                elif self._key in self.args_keys:
                    self._args = "string"
                    self._arg(ch)
            return
        if ch in "{[":
            if self._args:
                self._arg(ch)
            elif at_top and self._slot == "value":
                self._slot = "in_value"
                if self._key in self.args_keys:
                    self._args, self._args_depth = "nested", self._depth
                    self._arg(ch)
            self._depth += 1
            return
        if ch in "}]":
            if self._args:
                self._arg(ch)
            self._depth -= 1
            if self._args == "nested" and self._depth == self._args_depth:
                self._end_args()
            if self._depth <= 0:
                self.done = True
                self.value = _loads("".join(self._raw))
            return
        if self._args:
            self._arg(ch)
        elif at_top and ch == ":" and self._slot == "colon":
            self._slot = "value"
        elif at_top and ch == ",":
            self._slot = "key"
        elif at_top and ch not in _WS and self._slot == "value":
            self._slot = "in_value"
            if self._key in self.args_keys:
                self._args = "scalar"
                self._arg(ch)


class CallArrayReader:
    """A JSON array of call objects, each item read by a ``CallObjectReader``: ``feed`` returns
    the events of a piece with the item's index, ``("call", index, name)`` and ``("args", index,
    text)``. ``complete`` tells, without reading the text again, whether all of it is what
    ``json.loads`` reads as a non-empty array of objects, each with a string ``name`` and one of
    the arguments keys."""

    def __init__(self, args_keys: tuple[str, ...]):
        self.args_keys = args_keys
        self.calls: list[CallObjectReader] = []
        # between items: "start" (before "[") | "first" (after "[") | "next" (after ",")
        # | "after" (after an item) | "closed" (after "]"); "item" while one is read
        self._state = "start"
        self._sound = True  # all read so far begins such an array

    @property
    def complete(self) -> bool:
        return self._sound and self._state == "closed" and bool(self.calls)

    def feed(self, text: str) -> list[tuple]:
        out: list[tuple] = []
        i = 0
        while i < len(text):
            if self._state == "item":
                item, index = self.calls[-1], len(self.calls) - 1
                out.extend((kind, index, value) for kind, value in item.feed(text[i:]))
                i += item.consumed
                if item.done:
                    self._state = "after"
                    self._sound = self._sound and self._is_call(item.value)
                continue
            self._between(text[i])
            i += 1
        return out

    def _is_call(self, obj) -> bool:
        return isinstance(obj, dict) and isinstance(obj.get("name"), str) and any(k in obj for k in self.args_keys)

    def _between(self, ch: str) -> None:
        # an item is read at any "{" once the array is open, as the stream of a malformed array
        # goes on; only "complete" minds the commas
        if ch in _WS:
            return
        state = self._state
        if ch == "{" and state in ("first", "next", "after"):
            self._sound = self._sound and state != "after"
            self.calls.append(CallObjectReader(self.args_keys))
            self.calls[-1].feed(ch)
            self._state = "item"
        elif (ch, state) in ((",", "after"), ("[", "start"), ("]", "first"), ("]", "after")):
            self._state = {",": "next", "[": "first", "]": "closed"}[ch]
        else:
            self._sound = False
