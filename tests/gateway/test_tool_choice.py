"""tools, tool_choice, parallel_tool_calls and chat_template_kwargs read at the edge,
and the JSON schema ``required`` and a named function constrain the output to."""

from __future__ import annotations

import json

import jsonschema
import pytest

from services.gateway.errors import ApiError
from services.gateway.openai_requests import parse_chat
from services.gateway.tool_choice import require_tool_parser

USER = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]


def chat(**fields):
    return parse_chat({"messages": USER, **fields}, ("m",))


def constraint(**fields) -> dict | None:
    spec = chat(**fields).sampling_params.structured_outputs
    return None if spec is None else json.loads(spec.json)


def test_a_named_function_is_constrained_to_its_parameters():
    choice = {"type": "function", "function": {"name": "get_weather"}}
    request = chat(tools=TOOLS, tool_choice=choice)
    assert request.tool_calling.choice == "named" and request.tool_calling.function_name == "get_weather"
    assert constraint(tools=TOOLS, tool_choice=choice) == WEATHER
    # No parameters: an object without properties.
    assert constraint(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}) == \
        {"type": "object", "properties": {}}


def test_required_is_an_array_of_calls_any_of_the_tools():
    schema = constraint(tools=TOOLS, tool_choice="required")
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "nope", "parameters": {}}],
                [{"name": "get_time"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = constraint(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert single["maxItems"] == 1 and "maxItems" not in schema


def test_auto_and_none_do_not_constrain_and_the_tools_reach_the_tokenizer():
    for fields in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}, {"tools": TOOLS, "tool_choice": "none"}):
        request = chat(**fields, chat_template_kwargs={"enable_thinking": False})
        assert request.sampling_params.structured_outputs is None
        assert request.prompts[0]["tools"] == TOOLS
        assert request.prompts[0]["chat_template_kwargs"] == {"enable_thinking": False}
    assert chat(tools=TOOLS).tool_calling.choice == "auto"  # the default with tools
    assert not chat(tools=TOOLS, tool_choice="none").tool_calling.reads_calls
    assert chat().tool_calling is None and chat().prompts[0]["tools"] is None


@pytest.mark.parametrize("fields, param, words", [
    ({"tools": {"type": "function"}}, "tools", "must be a list"),
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools", "tools[0] must be"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools", "tools[0] (f)"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 5}}]}, "tools", "description"),
    ({"tools": [{"type": "function", "function": {"name": "f", "params": {}}}]}, "tools", "unknown fields"),
    ({"tools": TOOLS + [TOOLS[1]]}, "tools", "same name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "as an object"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice", "must be one of"),
    ({"tool_choice": "required"}, "tool_choice", "tools must be given"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", "boolean"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "must be an object"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "may not set tools"),
    ({"chat_template_kwargs": {"n": 2**70}}, "chat_template_kwargs", "64-bit"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"maximum": 2**64}}}]}, "tools",
     "64-bit"),
])
def test_bad_tool_fields_are_400s_naming_what_is_wrong(fields, param, words):
    with pytest.raises(ApiError) as info:
        chat(**fields)
    assert info.value.status == 400 and info.value.info.param == param
    assert words in info.value.info.message


def test_auto_needs_the_servers_parser():
    calling = chat(tools=TOOLS).tool_calling
    with pytest.raises(ApiError) as info:
        require_tool_parser(calling, False, "")
    assert "--enable-auto-tool-choice and --tool-call-parser" in info.value.info.message
    assert require_tool_parser(calling, True, "hermes").parser == "hermes"
    required = chat(tools=TOOLS, tool_choice="required").tool_calling
    assert require_tool_parser(required, False, "") is required  # needs no parser
