"""The tool-calling fields of a chat request, checked, and the constraint they imply.

``tools`` (OpenAI's ``{"type": "function", "function": {name, description,
parameters, strict}}``), ``tool_choice`` (``"none"``, ``"auto"``, ``"required"`` or
``{"type": "function", "function": {"name": ...}}``; ``"auto"`` when tools are given,
else ``"none"``, as OpenAI and vLLM default), ``parallel_tool_calls`` and
``chat_template_kwargs``. As vLLM does:

* ``required`` and a named function constrain the output with the structured-output
  machinery: a named function to its parameters' schema, ``required`` to an array
  (at least one item; at most one without parallel tool calls) of
  ``{"name": <one tool's name>, "parameters": <its schema>}`` objects, ``anyOf`` over
  the tools;
* ``auto`` needs the server's ``--enable-auto-tool-choice`` and ``--tool-call-parser``
  (a 400 otherwise), whose parser reads the model's free text;
* ``none``: the template still gets the tools; the output is plain content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from shared.protocol import StructuredOutputsParams

from .errors import invalid
from .structured_outputs import MAX_SPEC_CHARS

# OpenAI's rule for function names.
_FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
MAX_TOOLS = 128
# The names the template is rendered with: chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_NAMES = ("messages", "tools", "add_generation_prompt", "continue_final_message")
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolCalling:
    """What a chat request asks of tools. ``choice`` is "none", "auto", "required" or
    "named" (then ``function_name`` says which); ``parser`` is the server's
    ``--tool-call-parser``, set for "auto" once the endpoint checked it is enabled."""

    tools: tuple[dict, ...]
    choice: str
    function_name: str | None = None
    parallel: bool = True
    parser: str = ""

    @property
    def reads_calls(self) -> bool:
        """Whether the output is read as tool calls (every choice but "none")."""
        return self.choice != "none"


def tool_calling(body: dict) -> ToolCalling | None:
    """The request's tool settings; None when it has neither tools nor a tool choice."""
    tools = _tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid(f"parallel_tool_calls must be a boolean, got {parallel!r}", param="parallel_tool_calls")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    function_name = None
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise invalid('tool_choice as an object must be {"type": "function", "function": {"name": ...}}',
                          param="tool_choice")
        function_name, choice = function["name"], "named"
    elif choice not in CHOICES:
        raise invalid(f"tool_choice must be one of {', '.join(CHOICES)} or a named function, got {choice!r}",
                      param="tool_choice")
    if choice != "none" and not tools:
        raise invalid("when tool_choice is given (and not 'none'), tools must be given", param="tool_choice")
    if choice == "named" and function_name not in {t["function"]["name"] for t in tools}:
        raise invalid(f"tool_choice names the function {function_name!r}, which is not in tools",
                      param="tool_choice")
    if not tools and choice == "none" and parallel is None:
        return None
    return ToolCalling(tuple(tools), choice, function_name, parallel is not False)


def _tools(value) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid("tools must be a list of tool objects", param="tools")
    if len(value) > MAX_TOOLS:
        raise invalid(f"tools may hold at most {MAX_TOOLS} tools, got {len(value)}", param="tools")
    names: set[str] = set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise invalid(f'{where} must be {{"type": "function", "function": {{...}}}}', param="tools")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            raise invalid(f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {name!r}",
                          param="tools")
        where = f"{where} ({name})"
        if name in names:
            raise invalid(f"{where}: two tools have the same name", param="tools")
        names.add(name)
        unknown = set(function) - _FUNCTION_KEYS
        if unknown:
            raise invalid(f"{where}.function has unknown fields {sorted(unknown)}", param="tools")
        if not isinstance(function.get("description", ""), (str, type(None))):
            raise invalid(f"{where}.function.description must be a string", param="tools")
        if not isinstance(function.get("parameters", {}), (dict, type(None))):
            raise invalid(f"{where}.function.parameters must be a JSON schema object", param="tools")
        if not isinstance(function.get("strict", False), (bool, type(None))):
            raise invalid(f"{where}.function.strict must be a boolean", param="tools")
    return value


def _parameters(tool: dict) -> dict:
    """A function's parameters schema; none given: an object with no properties."""
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def tool_constraint(calling: ToolCalling | None) -> StructuredOutputsParams | None:
    """The JSON schema ``required`` or a named function constrains the output to."""
    if calling is None or calling.choice not in ("required", "named"):
        return None
    if calling.choice == "named":
        (tool,) = [t for t in calling.tools if t["function"]["name"] == calling.function_name]
        schema = _parameters(tool)
    else:
        schema = {
            "type": "array",
            "minItems": 1,
            "items": {"type": "object", "anyOf": [
                {"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                "parameters": _parameters(t)},
                 "required": ["name", "parameters"]}
                for t in calling.tools
            ]},
        }
        if not calling.parallel:
            schema["maxItems"] = 1
    text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    if len(text) > MAX_SPEC_CHARS:
        raise invalid(f"the tools' schemas may be at most {MAX_SPEC_CHARS} characters long", param="tools")
    return StructuredOutputsParams(json=text)


def chat_template_kwargs(body: dict) -> dict | None:
    value = body.get("chat_template_kwargs")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("chat_template_kwargs must be an object", param="chat_template_kwargs")
    reserved = [k for k in RESERVED_TEMPLATE_NAMES if k in value]
    if reserved:
        raise invalid(f"chat_template_kwargs may not set {', '.join(reserved)} (request fields of their own)",
                      param="chat_template_kwargs")
    return value or None


def require_tool_parser(calling: ToolCalling | None, enable_auto_tool_choice: bool,
                        tool_call_parser: str) -> ToolCalling | None:
    """``calling`` with the server's parser for "auto"; a 400 when auto is not enabled."""
    if calling is None or calling.choice != "auto":
        return calling
    if not (enable_auto_tool_choice and tool_call_parser):
        raise invalid('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                      param="tool_choice")
    return ToolCalling(calling.tools, calling.choice, calling.function_name, calling.parallel, tool_call_parser)
