"""A chat choice's output read as tool calls: OpenAI's ``tool_calls``, whole or streamed.

The gateway reads each choice's text here, after the detokenizer and the reorder
buffer, with one parser per choice (``tool_parsers``): ``required`` and a named
function with the readers of their constrained JSON, ``auto`` with the server's
``--tool-call-parser``. Streamed, a chunk's ``delta`` carries the content the parser
let through and ``tool_calls`` entries: a call's first (index, id
``chatcmpl-tool-<hex>`` as vLLM's, type, name) once its name is known, then fragments
of its arguments text. A whole answer is the same events gathered: ``content`` (null
when the model only called tools) and ``tool_calls`` with the arguments as a JSON
string. ``finish_reason`` is ``"tool_calls"`` when the model stopped by itself after
calling; a call cut off (``max_tokens``) or malformed leaves the engine's reason, and a
whole answer then returns the model's text as content without calls (vLLM's fallback).
Without parallel tool calls only the first call is kept.
"""

from __future__ import annotations

import uuid

from .tool_choice import ToolCalling
from .tool_parsers import TOOL_PARSERS, CallArguments, CallName, Content, Event, ToolParser
from .tool_parsers.forced import NamedFunctionOutput, RequiredCallsOutput


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def new_parser(calling: ToolCalling) -> ToolParser:
    if calling.choice == "named":
        return NamedFunctionOutput(calling.function_name)
    if calling.choice == "required":
        return RequiredCallsOutput()
    return TOOL_PARSERS[calling.parser]()


class ToolCallOutput:
    """One choice's text in, OpenAI's content and tool calls out."""

    def __init__(self, calling: ToolCalling) -> None:
        self.calling = calling
        self.parser = new_parser(calling)
        self.text_parts: list[str] = []
        self.content_parts: list[str] = []
        self.calls: list[dict] = []  # {"id", "type", "function": {"name", "arguments"}}

    def feed(self, text: str, finished: bool = False) -> dict:
        """The streamed ``delta`` (maybe empty) for the next text of this choice."""
        self.text_parts.append(text)
        events = self.parser.feed(text) if text else []
        if finished:
            events += self.parser.end()
        return self._delta(events)

    def _delta(self, events: list[Event]) -> dict:
        content: list[str] = []
        entries: list[dict] = []
        for event in events:
            if isinstance(event, Content):
                content.append(event.text)
                self.content_parts.append(event.text)
            elif event.index > 0 and not self.calling.parallel:
                continue  # only the first call without parallel tool calls
            elif isinstance(event, CallName):
                call = {"id": tool_call_id(), "type": "function", "function": {"name": event.name, "arguments": ""}}
                self.calls.append(call)
                entries.append({"index": event.index, "id": call["id"], "type": "function",
                                "function": {"name": event.name, "arguments": ""}})
            elif isinstance(event, CallArguments):
                self.calls[event.index]["function"]["arguments"] += event.text
                if entries and entries[-1]["index"] == event.index:
                    entries[-1]["function"]["arguments"] += event.text
                else:
                    entries.append({"index": event.index, "function": {"arguments": event.text}})
        delta: dict = {}
        if content and "".join(content):
            delta["content"] = "".join(content)
        if entries:
            delta["tool_calls"] = entries
        return delta

    @property
    def called(self) -> bool:
        """Whether the model called tools, all of them whole."""
        return bool(self.calls) and not self.parser.failed

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return "tool_calls" if engine_reason == "stop" and self.called else engine_reason

    def message(self) -> dict:
        """The whole answer's message (after the last ``feed``, with ``finished``)."""
        if not self.called:
            return {"role": "assistant", "content": "".join(self.text_parts), "tool_calls": []}
        content = "".join(self.content_parts)
        return {"role": "assistant", "content": content or None, "tool_calls": self.calls}


def whole_answer(calling: ToolCalling, text: str, engine_reason: str | None) -> tuple[dict, str | None]:
    """The message and finish reason of a whole (non-streamed) choice."""
    output = ToolCallOutput(calling)
    output.feed(text, finished=True)
    return output.message(), output.finish_reason(engine_reason)
