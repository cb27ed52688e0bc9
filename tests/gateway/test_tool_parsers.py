"""The tool-call parsers and the readers of constrained tool output, fed as a stream.

Every text is fed whole and in pieces of every size from 1 character on: the content
and the calls (name, arguments text) gathered from the events must not depend on how
the text was cut.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from services.gateway.tool_parsers import (
    CallArguments, CallName, Content, HermesToolParser, Llama3JsonToolParser, NamedFunctionOutput,
    RequiredCallsOutput,
)
from services.gateway.tool_parsers.json_call import JsonCallScanner


def read(make, text: str, step: int):
    parser = make()
    events = []
    for i in range(0, len(text), step):
        events += parser.feed(text[i:i + step])
    events += parser.end()
    content = "".join(e.text for e in events if isinstance(e, Content))
    names = [(e.index, e.name) for e in events if isinstance(e, CallName)]
    arguments: dict[int, str] = defaultdict(str)
    for e in events:
        if isinstance(e, CallArguments):
            assert e.index in {i for i, _ in names}, "arguments before the call's name"
            arguments[e.index] += e.text
    return content, [n for _, n in names], [arguments[i] for i, _ in names], parser.failed


def read_every_way(make, text: str):
    results = [read(make, text, step) for step in (1, 2, 3, 5, 7, 11, max(len(text), 1))]
    assert all(r == results[0] for r in results), results
    return results[0]


WEATHER = '{"city": "Paris", "days": [1, {"note": "a } and a \\" inside"}]}'


def test_hermes_text_before_and_two_calls():
    text = f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n' \
           '<tool_call>{"arguments": {"zone": "CET"}, "name": "get_time"}</tool_call>\n'
    content, names, arguments, failed = read_every_way(HermesToolParser, text)
    assert content == "Let me check."
    assert names == ["get_weather", "get_time"]
    assert arguments == [WEATHER, '{"zone": "CET"}'] and json.loads(arguments[0])["days"][1]["note"]
    assert not failed


@pytest.mark.parametrize("text", ["plain answer", "a < b and <tool but no call  \n", "", "  spaced  "])
def test_hermes_without_calls_is_the_text_exactly(text):
    assert read_every_way(HermesToolParser, text) == (text, [], [], False)


def test_hermes_call_without_arguments_or_end_tag_and_text_after():
    content, names, arguments, failed = read_every_way(
        HermesToolParser, '<tool_call>{"name": "now"}\nDone.')
    assert (content, names, arguments, failed) == ("Done.", ["now"], ["{}"], False)


def test_hermes_quoted_arguments_are_the_string():
    content, names, arguments, _ = read_every_way(
        HermesToolParser, '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert names == ["f"] and arguments == ['{"x": 1}']


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "f", "arguments": {"x": 1',  # cut off
    '<tool_call>not json</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
])
def test_hermes_broken_calls_fail(text):
    assert read_every_way(HermesToolParser, text)[3] is True


def test_llama3_json_calls_after_python_tag_separated_by_semicolons():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; ' \
           '{"name": "get_time", "parameters": {}}'
    assert read_every_way(Llama3JsonToolParser, text) == \
        ("", ["get_weather", "get_time"], ['{"city": "Paris"}', "{}"], False)


def test_llama3_json_plain_object_and_arguments_key():
    text = '  {"name": "f", "arguments": {"a": [1, 2]}}'
    assert read_every_way(Llama3JsonToolParser, text) == ("", ["f"], ['{"a": [1, 2]}'], False)


@pytest.mark.parametrize("text", ["Hello there", "  The answer is {x}", "<|python", ""])
def test_llama3_json_text_is_content(text):
    assert read_every_way(Llama3JsonToolParser, text) == (text, [], [], False)


@pytest.mark.parametrize("text", ['{"name": "f", "parameters": {"a": 1', '{"name": "f", "parameters": {}} trailing'])
def test_llama3_json_broken_calls_fail(text):
    content, _, _, failed = read_every_way(Llama3JsonToolParser, text)
    assert failed


def test_required_array_of_calls():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}} , {"name":"get_time","parameters":{}}]'
    assert read_every_way(RequiredCallsOutput, text) == \
        ("", ["get_weather", "get_time"], ['{"city": "Paris"}', "{}"], False)


@pytest.mark.parametrize("text", ['[{"name": "f", "parameters": {', "[]", '{"name": "f"}'])
def test_required_incomplete_or_wrong_shape_fails(text):
    assert read_every_way(RequiredCallsOutput, text)[3] is True


def test_named_function_output_is_its_arguments():
    assert read_every_way(lambda: NamedFunctionOutput("f"), '{"city": "Paris"}') == \
        ("", ["f"], ['{"city": "Paris"}'], False)
    assert read_every_way(lambda: NamedFunctionOutput("f"), '{"city": "Pa')[3] is True


def test_scanner_tells_how_much_of_the_text_the_call_took():
    scanner = JsonCallScanner(("arguments",))
    assert scanner.feed('{"name": "f", "arguments": {"a": "}"}} rest') == len('{"name": "f", "arguments": {"a": "}"}}')
    assert scanner.done and not scanner.malformed and scanner.name == "f"
    assert scanner.arguments() == '{"a": "}"}'
