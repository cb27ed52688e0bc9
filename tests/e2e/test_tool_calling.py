"""Tool calling through the whole stack with the default model and the official ``openai``
client: a named function and ``tool_choice: "required"`` return tool calls whose
arguments validate against the function's parameters (``jsonschema``), whole and
streamed, sampled at temperature 1; a follow-up turn with the assistant's tool calls
and the tool results is served. The stack runs ``--enable-auto-tool-choice
--tool-call-parser hermes``: SmolLM2's template has no tool section, so the prompt
carries the tools through the built-in fallback template.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from openai import AsyncOpenAI

from services.launch.nats_server import free_port
from services.launch.stack import StackConfig
from tests.e2e.stacks import running_stack

MODEL = "SmolLM2-135M-Instruct"
TOOL_ID = re.compile(r"^chatcmpl-tool-[0-9a-f]{32}$")
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"],
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather forecast for a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": TIME}},
]
SCHEMA_OF = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next three days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    args = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--max-num-seqs", "16"]
    config = StackConfig(port=free_port(), args=args, log_dir=str(tmp_path_factory.mktemp("tool-stack-logs")))
    with running_stack(config) as stack:
        yield stack


@pytest.fixture
async def client(stack):
    async with AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=600) as c:
        yield c


def check_calls(calls: list[tuple[str, str, str]], names: set[str]) -> None:
    """(id, name, arguments) of each call: known names, arguments valid for the function."""
    assert calls
    for call_id, name, arguments in calls:
        assert TOOL_ID.match(call_id) and name in names
        jsonschema.validate(json.loads(arguments), SCHEMA_OF[name])


async def whole(client, temperature: float = 1.0, **fields) -> list:
    response = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=temperature,
                                                    max_tokens=300, n=3, **fields)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.content is None
        check_calls([(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls],
                    {NAMED["function"]["name"]} if fields["tool_choice"] == NAMED else set(SCHEMA_OF))
    return response.choices


async def streamed(client, temperature: float = 1.0, **fields) -> list:
    stream = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=temperature,
                                                  max_tokens=300, n=3, stream=True, **fields)
    calls: dict[int, dict[int, list[str]]] = {0: {}, 1: {}, 2: {}}
    finish = {}
    async for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content
            for entry in choice.delta.tool_calls or ():
                if entry.id is not None:
                    calls[choice.index][entry.index] = [entry.id, entry.function.name, entry.function.arguments or ""]
                else:
                    calls[choice.index][entry.index][2] += entry.function.arguments
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls", 2: "tool_calls"}
    names = {NAMED["function"]["name"]} if fields["tool_choice"] == NAMED else set(SCHEMA_OF)
    for per_choice in calls.values():
        assert sorted(per_choice) == list(range(len(per_choice)))
        check_calls([tuple(c) for c in per_choice.values()], names)
    return list(calls.values())


async def test_named_function(client):
    choices = await whole(client, tool_choice=NAMED)
    assert all(len(c.message.tool_calls) == 1 for c in choices)


async def test_named_function_streamed(client):
    await streamed(client, tool_choice=NAMED)


# SmolLM2 sampled under `required` with parallel calls allowed may go on calling until
# max_tokens: sampled with one call at most, and greedy (two calls) with parallel calls.
async def test_required(client):
    single = await whole(client, tool_choice="required", parallel_tool_calls=False)
    assert all(len(c.message.tool_calls) == 1 for c in single)
    await whole(client, temperature=0.0, tool_choice="required")


async def test_required_streamed(client):
    single = await streamed(client, tool_choice="required", parallel_tool_calls=False)
    assert all(len(calls) == 1 for calls in single)
    await streamed(client, temperature=0.0, tool_choice="required")


async def test_a_follow_up_turn_with_tool_results(client):
    first = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                                 max_tokens=150)
    call = first.choices[0].message.tool_calls[0]
    turn = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny all week, 24 degrees."},
    ]
    plain = await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    follow_up = await client.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, tool_choice="none",
                                                     max_tokens=20, temperature=0)
    assert follow_up.choices[0].finish_reason in ("stop", "length") and follow_up.choices[0].message.content
    # The prompt holds the tools, the call and its result: far longer than the question alone.
    assert follow_up.usage.prompt_tokens > plain.usage.prompt_tokens + 100
