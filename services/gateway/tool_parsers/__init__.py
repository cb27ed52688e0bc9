"""Tool-call parsers by their ``--tool-call-parser`` names (vLLM's), and the readers of
``required`` / named-function output. Another format is one module here and one entry
in ``TOOL_PARSERS``."""

from __future__ import annotations

from .base import CallArguments, CallName, Content, Event, ToolParser
from .forced import NamedFunctionOutput, RequiredCallsOutput
from .hermes import HermesToolParser
from .llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}

__all__ = ["TOOL_PARSERS", "CallArguments", "CallName", "Content", "Event", "HermesToolParser", "Llama3JsonToolParser",
           "NamedFunctionOutput",
           "RequiredCallsOutput", "ToolParser"]
