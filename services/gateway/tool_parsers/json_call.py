"""One tool call's JSON object read as it arrives: its name and its arguments' text.

A call is an object such as ``{"name": "f", "arguments": {...}}`` (Hermes's key) or
``{"name": "f", "parameters": {...}}`` (Llama 3's, and the ``required`` constraint's).
``JsonCallScanner`` takes the object's characters as they come and knows, at every
point, the name once its string is complete and as much of the arguments' text as is
surely part of it: an object or array value grows with each character (all of it lies
before its closing bracket); a string or a number is known once it ends. The arguments'
text is the model's own (not re-serialised), so the fragments a stream sends add up
to exactly what a whole answer holds.
"""

from __future__ import annotations

import json

_WHITESPACE = " \t\r\n"


class JsonCallScanner:
    """Feed it the characters from the call's ``{`` on; ``done`` once its ``}`` came."""

    def __init__(self, args_keys: tuple[str, ...]) -> None:
        self.args_keys = args_keys
        self.chars: list[str] = []
        self.done = False
        self.malformed = False
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._expect = "open"  # at depth 1: "key", "colon", "value", "comma"
        self._key_start = -1
        self._key: str | None = None
        self._value_key: str | None = None  # the top-level key whose value is being read
        self._value_start = -1
        self._value_kind = ""  # "container", "string" or "scalar"
        self.name: str | None = None
        self._args_start = -1
        self._args_end = -1  # past the arguments' last character, once they ended
        self._args_string = False

    # ------------------------------------------------------------------ reading

    def feed(self, text: str) -> int:
        """Read ``text``; returns how many of its characters belong to the call (all,
        unless its closing ``}`` came before the end of ``text``)."""
        for used, c in enumerate(text):
            if self.done or self.malformed:
                return used
            self.chars.append(c)
            self._step(c, len(self.chars) - 1)
        return len(text)

    def _step(self, c: str, i: int) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if self._depth == 1:
                    self._string_ended(i)
            return
        if self._expect == "open":
            if c == "{":
                self._depth, self._expect = 1, "key"
            elif c not in _WHITESPACE:
                self.malformed = True
            return
        if self._depth == 1:
            self._top_level(c, i)
        elif c == '"':
            self._in_string = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == 1:
                self._value_ended(i + 1)

    def _top_level(self, c: str, i: int) -> None:
        if self._expect == "value" and self._value_start >= 0 and self._value_kind == "scalar":
            if c in ",}" or c in _WHITESPACE:
                self._value_ended(i)
            else:
                return
        if c in _WHITESPACE:
            return
        if self._expect == "key":
            if c == '"':
                self._in_string, self._key_start = True, i
            elif c == "}" and self._key is None:
                self._close()
            else:
                self.malformed = True
        elif self._expect == "colon":
            if c == ":":
                self._expect, self._value_key, self._value_start = "value", self._key, -1
            else:
                self.malformed = True
        elif self._expect == "value" and self._value_start < 0:
            self._value_start = i
            if self._value_key in self.args_keys:
                self._args_start = i
            if c == '"':
                self._value_kind, self._in_string = "string", True
            elif c in "{[":
                self._value_kind, self._depth = "container", 2
            else:
                self._value_kind = "scalar"
        elif self._expect == "comma":
            if c == ",":
                self._expect, self._key = "key", None
            elif c == "}":
                self._close()
            else:
                self.malformed = True

    def _string_ended(self, i: int) -> None:
        if self._expect == "key":
            self._key = json.loads("".join(self.chars[self._key_start:i + 1]))
            self._expect = "colon"
        else:
            self._value_ended(i + 1)

    def _value_ended(self, end: int) -> None:
        text = "".join(self.chars[self._value_start:end])
        if self._value_key == "name" and self._value_kind == "string":
            self.name = json.loads(text)
        if self._value_key in self.args_keys:
            self._args_end, self._args_string = end, self._value_kind == "string"
        self._expect, self._value_start = "comma", -1

    def _close(self) -> None:
        self._depth, self.done = 0, True
        try:
            call = json.loads(self.text)
        except ValueError:
            self.malformed = True
            return
        if not isinstance(call.get("name"), str):
            self.malformed = True

    # ------------------------------------------------------------------ results

    @property
    def text(self) -> str:
        return "".join(self.chars)

    def arguments(self) -> str:
        """The arguments' text known so far: all of it once ``args_complete``. A string
        value (some models quote their arguments) counts once whole, as its content."""
        if self._args_start < 0:
            return ""
        if self._args_end >= 0:
            text = "".join(self.chars[self._args_start:self._args_end])
            return json.loads(text) if self._args_string else text
        if self._value_kind == "container" and self._value_key in self.args_keys:
            return "".join(self.chars[self._args_start:])
        return ""

    @property
    def args_complete(self) -> bool:
        return self._args_end >= 0

    @property
    def has_arguments(self) -> bool:
        return self._args_start >= 0
