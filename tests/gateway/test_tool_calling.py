"""Tool calls through the gateway, with the official ``openai`` client, on scripted model
output (the fake engine's ``HERMESCALLS`` script: text, then two Hermes calls, written
in pieces that cut the tags and the JSON apart).

The gateway here serves ``tool_choice: "auto"`` with ``--tool-call-parser hermes``.
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from services.gateway.uvicorn_runner import GatewayServer

from .conftest import MODEL, gateway_config, until_engine_ready
from .fake_engine import SCRIPTS

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}},
]
ASK = [{"role": "user", "content": "HERMESCALLS What is the weather in Paris?"}]
EXPECTED_CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
TOOL_ID = re.compile(r"^chatcmpl-tool-[0-9a-f]{32}$")


@pytest.fixture(scope="module")
async def gateway(nats_server, fake):
    config = gateway_config(enable_auto_tool_choice=True, tool_call_parser="hermes")
    async with GatewayServer(config, nats_url=nats_server.url) as server:
        await until_engine_ready(server)
        yield server


def calls_of(tool_calls) -> list[tuple[str, dict]]:
    for call in tool_calls:
        assert TOOL_ID.match(call.id) and call.type == "function"
    assert len({call.id for call in tool_calls}) == len(tool_calls)
    return [(call.function.name, json.loads(call.function.arguments)) for call in tool_calls]


async def test_auto_hermes_whole_answer(client):
    response = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert calls_of(choice.message.tool_calls) == EXPECTED_CALLS


async def test_auto_hermes_streamed(client):
    stream = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, stream=True)
    content, calls, finish = "", {}, None
    async for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for entry in delta.tool_calls or ():
                if entry.index not in calls:  # a call's first entry: its id and name
                    assert entry.id and entry.function.name and entry.type == "function"
                    calls[entry.index] = [entry.id, entry.function.name, entry.function.arguments or ""]
                else:
                    assert entry.id is None and entry.function.name is None
                    calls[entry.index][2] += entry.function.arguments
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and content == "Let me check."
    assert sorted(calls) == [0, 1]
    for i, (call_id, name, arguments) in calls.items():
        assert TOOL_ID.match(call_id)
        assert (name, json.loads(arguments)) == EXPECTED_CALLS[i]


async def test_each_choice_is_read_apart_and_parallel_calls_can_be_refused(client):
    response = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, n=2)
    assert [calls_of(c.message.tool_calls) for c in response.choices] == [EXPECTED_CALLS] * 2
    single = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, parallel_tool_calls=False)
    assert calls_of(single.choices[0].message.tool_calls) == EXPECTED_CALLS[:1]


async def test_a_call_cut_off_returns_the_text_and_the_engines_reason(client):
    script = SCRIPTS["HERMESCALLS"]
    response = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=12)
    (choice,) = response.choices
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content == "".join(script[:12])


async def test_tool_choice_none_leaves_the_text_alone(client, fake):
    response = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                                    extra_body={"chat_template_kwargs": {"flavour": "plain"}})
    assert response.choices[0].message.content == "".join(SCRIPTS["HERMESCALLS"])
    assert response.choices[0].finish_reason == "stop" and not response.choices[0].message.tool_calls
    # The tools and the template's kwargs went to the tokenizer with the messages.
    sent = fake.prompts[-1]
    assert sent.tools == TOOLS and sent.chat_template_kwargs == {"flavour": "plain"}


async def test_tool_messages_of_a_follow_up_turn_are_accepted(client, fake):
    turn = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "HERMESCALLS sunny"},
    ]
    response = await client.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS)
    assert response.choices[0].finish_reason == "tool_calls"
    assert fake.prompts[-1].messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
async def test_bad_tool_requests_are_400s_with_openais_error_body(http, fields, param):
    response = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, **fields})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


async def test_auto_without_the_flags_is_a_400(nats_server, fake):
    async with GatewayServer(gateway_config(), nats_url=nats_server.url) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
            body = {"model": MODEL, "messages": ASK, "tools": TOOLS}
            for fields in ({}, {"tool_choice": "auto"}):
                response = await http.post("/v1/chat/completions", json={**body, **fields})
                assert response.status_code == 400
                error = response.json()["error"]
                assert "--enable-auto-tool-choice" in error["message"] and error["param"] == "tool_choice"
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0) as client:
            with pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)


async def test_llama3_json_parser_whole_and_streamed(nats_server, fake):
    config = gateway_config(enable_auto_tool_choice=True, tool_call_parser="llama3_json")
    ask = [{"role": "user", "content": "LLAMACALLS weather?"}]
    async with GatewayServer(config, nats_url=nats_server.url) as server:
        await until_engine_ready(server)
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0) as client:
            response = await client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS)
            assert response.choices[0].finish_reason == "tool_calls"
            assert response.choices[0].message.content is None
            assert calls_of(response.choices[0].message.tool_calls) == EXPECTED_CALLS
            stream = await client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, stream=True)
            calls: dict[int, list[str]] = {}
            async for chunk in stream:
                for choice in chunk.choices:
                    for entry in choice.delta.tool_calls or ():
                        calls.setdefault(entry.index, [entry.function.name, ""])[1] += entry.function.arguments
            assert [(name, json.loads(arguments)) for name, arguments in calls.values()] == EXPECTED_CALLS
