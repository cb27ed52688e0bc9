"""The structured-output request fields, in OpenAI's and vLLM's names, read at the edge."""

from __future__ import annotations

import pytest

from services.gateway.errors import ApiError
from services.gateway.openai_requests import parse_chat, parse_completion
from shared.protocol import StructuredOutputsParams as Spec

NAMES = ("m",)
USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
SCHEMA_TEXT = '{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"string"}}}'


def chat(**fields):
    return parse_chat({"messages": USER, **fields}, NAMES).sampling_params.structured_outputs


def completion(**fields):
    return parse_completion({"prompt": "x", **fields}, NAMES).sampling_params.structured_outputs


@pytest.mark.parametrize("fields, expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, Spec(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     Spec(json=SCHEMA_TEXT)),
    ({"structured_outputs": {"json": SCHEMA}}, Spec(json=SCHEMA_TEXT)),
    ({"structured_outputs": {"json": '{"type": "object",  "properties": {"b": {"type": "integer"}, '
                                     '"a": {"type": "string"}}}'}}, Spec(json=SCHEMA_TEXT)),
    ({"structured_outputs": {"regex": r"\d+", "disable_any_whitespace": False}}, Spec(regex=r"\d+")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, Spec(choice=["a", "b"])),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, Spec(grammar='root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, Spec(json_object=True)),
    ({"guided_json": SCHEMA}, Spec(json=SCHEMA_TEXT)),
    ({"guided_regex": "a|b"}, Spec(regex="a|b")),
    ({"guided_choice": ["x"], "guided_decoding_backend": "xgrammar"}, Spec(choice=["x"])),
    ({"guided_grammar": 'root ::= "a"'}, Spec(grammar='root ::= "a"')),
])
def test_every_name_reads_into_one_spec_keys_in_the_order_given(fields, expected):
    assert chat(**fields) == expected
    assert completion(**fields) == expected


def test_structural_tag_is_carried_as_compact_json():
    tag = {"type": "structural_tag", "structures": [], "triggers": ["<f>"]}
    text = '{"type":"structural_tag","structures":[],"triggers":["<f>"]}'
    assert chat(response_format=tag) == Spec(structural_tag=text)
    assert chat(structured_outputs={"structural_tag": text}) == Spec(structural_tag=text)


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format", "only one kind"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.regex", "only one kind"),
    ({"response_format": {"type": "xml"}}, "response_format", "type must be"),
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "response_format", "schema"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"json": [1]}}, "structured_outputs.json", "JSON schema"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "non-empty string"),
    ({"structured_outputs": {"whitespace_pattern": " *", "regex": "a"}}, "structured_outputs.whitespace_pattern",
     "not supported"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "unknown field"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object", "boolean"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "not supported"),
    ({"guided_regex": "a" * 70000}, "guided_regex", "at most"),
])
def test_refusals_name_the_field(fields, param, words):
    with pytest.raises(ApiError, match=words) as info:
        chat(**fields)
    assert info.value.info.param == param and info.value.info.status == 400
