"""``--tool-call-parser llama3_json``: Llama 3.1/3.2's JSON calls.

The whole answer is either content or calls: ``{"name": ..., "parameters": {...}}``
objects (``"arguments"`` is read too), possibly after ``<|python_tag|>`` and separated
by ``;``. An answer whose first non-blank text is neither is content.
"""

from __future__ import annotations

from .base import CallReader, Content, Event, ToolParser

PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = " \t\r\n;"


class Llama3JsonToolParser(ToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._mode = "start"  # "start", "text", "calls", "call", "failed"
        self._call: CallReader | None = None
        self._calls_text = ""  # the calls' text so far, for a failure's content

    def _advance(self, events: list[Event]) -> bool:
        if self._mode in ("text", "failed"):
            events.append(Content(self._pending))
            self._pending = ""
            return False
        if self._mode == "start":
            head = self._pending.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return False
            if head.startswith(PYTHON_TAG):
                self._calls_text, self._pending, self._mode = PYTHON_TAG, head[len(PYTHON_TAG):], "calls"
            else:
                self._mode = "calls" if head.startswith("{") else "text"
            return True
        if self._mode == "calls":
            rest = self._pending.lstrip(_SEPARATORS)
            self._calls_text += self._pending[: len(self._pending) - len(rest)]
            self._pending = rest
            if not rest:
                return False
            if not rest.startswith("{"):
                return self._fail(events)
            self._call = CallReader(self.num_calls, ("parameters", "arguments"))
            self.num_calls += 1
            self._mode = "call"
            return True
        used, news = self._call.feed(self._pending)
        self._calls_text += self._pending[:used]
        self._pending = self._pending[used:]
        events.extend(news)
        if self._call.malformed:
            return self._fail(events)
        if self._call.done:
            self._mode = "calls"
            return True
        return False

    def _fail(self, events: list[Event]) -> bool:
        self.failed, self._mode = True, "failed"
        events.append(Content(self._calls_text))
        return True

    def end(self) -> list[Event]:
        if self._mode == "call":
            self.failed = True
            return []
        rest, self._pending = self._pending, ""
        return [Content(rest)] if rest and self._mode != "calls" else []
