"""The tool-call parser interface: one choice's text in, content and tool calls out.

A parser reads one choice's output as it arrives (``feed``, then ``end`` once the
choice is done) and says, in order, what is ordinary content and what is a tool call:
``Content``, ``CallName`` (a call begins; sent once its name is known) and
``CallArguments`` (the next fragment of that call's arguments text). It holds back
text that may still turn out to be part of a call (a marker's first characters, the
whitespace before a call). ``failed`` says that a call was malformed or cut off: a
whole answer then returns the model's text as content, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass

from .json_call import JsonCallScanner


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallName:
    index: int
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str


Event = Content | CallName | CallArguments


class ToolParser:
    """Reads one choice's text: subclasses implement ``_advance`` (one step over the
    pending text; False when it must wait for more) and ``end``."""

    def __init__(self) -> None:
        self.failed = False
        self.num_calls = 0
        self._pending = ""  # text read but not yet told

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        events: list[Event] = []
        while self._pending and self._advance(events):
            pass
        return events

    def _advance(self, events: list[Event]) -> bool:
        raise NotImplementedError

    def end(self) -> list[Event]:
        raise NotImplementedError


class CallReader:
    """One call's JSON object as it arrives, and what of it has been told."""

    def __init__(self, index: int, args_keys: tuple[str, ...]) -> None:
        self.index = index
        self.scanner = JsonCallScanner(args_keys)
        self._named = False
        self._sent = 0

    def feed(self, text: str) -> tuple[int, list[Event]]:
        """How many characters of ``text`` the call took, and the news they bring."""
        used = self.scanner.feed(text)
        return used, self._news()

    @property
    def done(self) -> bool:
        return self.scanner.done and not self.scanner.malformed

    @property
    def malformed(self) -> bool:
        return self.scanner.malformed

    def _news(self) -> list[Event]:
        scanner = self.scanner
        if scanner.malformed:
            return []
        events: list[Event] = []
        if not self._named and scanner.name is not None:
            events.append(CallName(self.index, scanner.name))
            self._named = True
        if self._named:
            arguments = scanner.arguments()
            if scanner.done and not scanner.has_arguments:
                arguments = "{}"  # a call without arguments takes none
            if len(arguments) > self._sent:
                events.append(CallArguments(self.index, arguments[self._sent:]))
                self._sent = len(arguments)
        return events


def held_marker_prefix(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
