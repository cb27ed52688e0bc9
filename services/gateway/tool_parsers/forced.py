"""The output of ``tool_choice`` ``required`` and a named function, read as tool calls.

Both are constrained by their JSON schema (``services/gateway/tool_choice.py``), so no
marker is needed: a named function's output is its arguments object, ``required``'s an
array of ``{"name": ..., "parameters": {...}}`` objects (vLLM's shape).
"""

from __future__ import annotations

import json

from .base import CallName, CallArguments, CallReader, Event, ToolParser


class NamedFunctionOutput(ToolParser):
    """The whole output is the named function's arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self._text = ""

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        if not self.num_calls:
            self.num_calls = 1
            events.append(CallName(0, self.name))
        if self._text or text.strip():
            text = text if self._text else text.lstrip()
            self._text += text
            events.append(CallArguments(0, text))
        return events

    def end(self) -> list[Event]:
        try:
            json.loads(self._text)
        except ValueError:
            self.failed = True  # cut off (max_tokens) before the object closed
        return self.feed("") if not self.num_calls else []


class RequiredCallsOutput(ToolParser):
    """An array of calls: ``[{"name": ..., "parameters": ...}, ...]``."""

    def __init__(self) -> None:
        super().__init__()
        self._mode = "open"  # "open" ([), "item" ({ or ]), "call", "next" (, or ]), "closed"
        self._call: CallReader | None = None

    def _advance(self, events: list[Event]) -> bool:
        if self.failed:
            return False
        if self._mode == "call":
            used, news = self._call.feed(self._pending)
            self._pending = self._pending[used:]
            events.extend(news)
            if self._call.malformed:
                self.failed = True
            elif self._call.done:
                self._mode = "next"
            return self._call.done
        self._pending = self._pending.lstrip()
        if not self._pending:
            return False
        c = self._pending[0]
        if self._mode == "open" and c == "[":
            self._mode = "item"
        elif self._mode == "item" and c == "{":
            self._call = CallReader(self.num_calls, ("parameters",))
            self.num_calls += 1
            self._mode = "call"
            return True  # the "{" is the call's
        elif self._mode in ("item", "next") and c == "]" and self.num_calls:
            self._mode = "closed"
        elif self._mode == "next" and c == ",":
            self._mode = "item"
        elif self._mode != "closed":
            self.failed = True
            return False
        self._pending = self._pending[1:]
        return True

    def end(self) -> list[Event]:
        if self._mode != "closed":
            self.failed = True
        return []
