"""``--tool-call-parser hermes``: calls as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``.

The format of Hermes 2 Pro, Qwen 2.5 and our fallback tools template. Text outside the
tags is content; the whitespace around calls is dropped. A call's closing tag may be
missing (a model that stops right after the object).
"""

from __future__ import annotations

from .base import CallReader, Content, Event, ToolParser, held_marker_prefix

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._mode = "text"  # "text", "call", "close" (after a call's object), "failed"
        self._call: CallReader | None = None

    def _advance(self, events: list[Event]) -> bool:
        if self._mode == "failed":
            events.append(Content(self._pending))
            self._pending = ""
            return False
        if self._mode == "text":
            return self._text(events)
        if self._mode == "call":
            used, news = self._call.feed(self._pending)
            self._pending = self._pending[used:]
            events.extend(news)
            if self._call.malformed:
                self.failed, self._mode = True, "failed"
                events.append(Content(START + self._call.scanner.text))
                return True
            if self._call.done:
                self._mode = "close"
                return True
            return False
        # "close": the end tag (or, missing, whatever follows the object)
        self._pending = self._pending.lstrip()
        if not self._pending or (END.startswith(self._pending) and self._pending != END):
            return False
        if self._pending.startswith(END):
            self._pending = self._pending[len(END):]
        self._mode = "text"
        return True

    def _text(self, events: list[Event]) -> bool:
        if self.num_calls:  # no whitespace between or after calls
            self._pending = self._pending.lstrip()
        start = self._pending.find(START)
        if start >= 0:
            before = self._pending[:start].rstrip()
            if before:
                events.append(Content(before))
            self._pending = self._pending[start + len(START):]
            self._call = CallReader(self.num_calls, ("arguments", "parameters"))
            self.num_calls += 1
            self._mode = "call"
            return True
        held = held_marker_prefix(self._pending, START)
        sure = self._pending[: len(self._pending) - held].rstrip()
        if sure:
            events.append(Content(sure))
            self._pending = self._pending[len(sure):]
        return False

    def end(self) -> list[Event]:
        if self._mode == "call":
            self.failed = True  # cut off inside a call
            return []
        rest = self._pending.rstrip() if self.num_calls else self._pending
        self._pending = ""
        return [Content(rest)] if rest else []
