"""Tools for chat templates that have no tool section: the built-in fallback.

A model's own template that mentions ``tools`` renders the request's tools, the
assistants' ``tool_calls`` and the ``tool`` messages itself. One that does not (the
default SmolLM2's) still frames the turns, and ``tools_in_messages`` rewrites the
conversation into plain messages it can render, with the pieces of
``templates/tool_fallback.jinja`` (Hermes's format, which ``--tool-call-parser hermes``
reads back):

* the tools' list and how to call them join the system message (one is added first
  when there is none);
* an assistant's tool calls are appended to its content as ``<tool_call>`` blocks;
* ``tool`` messages, consecutive ones merged, become one user message of
  ``<tool_response>`` blocks (a role every template knows).
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from typing import Any

from shared.chat_template import compile_template

_MENTIONS_TOOLS = re.compile(r"\btools\b")


def template_handles_tools(template: str) -> bool:
    """Whether a chat template renders tools itself (it reads a ``tools`` variable)."""
    return bool(_MENTIONS_TOOLS.search(template))


@functools.cache
def _fallback():
    source = resources.files("shared").joinpath("templates/tool_fallback.jinja").read_text(encoding="utf-8")
    return compile_template(source).module


def tools_in_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``messages`` with the tools, the tool calls and the tool results written into
    plain system / assistant / user contents (unchanged when there are none)."""
    if not tools and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return messages
    fallback = _fallback()
    result: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool":
            if result and result[-1].get("_tool_results") is not None:
                result[-1]["_tool_results"].append(message)
            else:
                result.append({"role": "user", "_tool_results": [message]})
        elif message.get("tool_calls"):
            calls = str(fallback.tool_calls(message["tool_calls"])).strip()
            content = message.get("content") or ""
            rewritten = {k: v for k, v in message.items() if k != "tool_calls"}
            rewritten["content"] = f"{content}\n{calls}" if content else calls
            result.append(rewritten)
        else:
            result.append(message)
    for message in result:
        results = message.pop("_tool_results", None)
        if results is not None:
            message["content"] = str(fallback.tool_responses(results)).strip()
    if tools:
        preamble = str(fallback.tools_preamble(tools)).strip()
        if result and result[0]["role"] == "system":
            result[0] = {**result[0], "content": f"{result[0]['content']}\n\n{preamble}"}
        else:
            result.insert(0, {"role": "system", "content": preamble})
    return result
