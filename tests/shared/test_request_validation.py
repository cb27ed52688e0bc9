"""Sampling-parameter and request checks: OpenAI / vLLM ranges, the offending param named."""

from __future__ import annotations

import math

import pytest

from shared.protocol import SamplingParams, TokenizeRequest
from shared.request_validation import (
    InvalidRequest,
    chat_messages,
    resolve_max_tokens,
    validate_request_shape,
    validate_sampling_params,
)

VOCAB = 1000

BAD_PARAMS = [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=2.01), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=-0.01), "min_p"),
    (dict(min_p=1.01), "min_p"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=math.inf), "repetition_penalty"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=21), "logprobs"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(stop_token_ids=[VOCAB]), "stop_token_ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
]


@pytest.mark.parametrize("params, param", BAD_PARAMS)
def test_out_of_range_params_are_rejected_naming_the_param(params, param):
    with pytest.raises(InvalidRequest) as e:
        validate_sampling_params(SamplingParams(**params), VOCAB)
    assert e.value.error.param == param and e.value.error.status == 400
    assert e.value.error.type == "invalid_request_error" and param in e.value.error.message


def test_edge_values_are_accepted_and_top_k_minus_one_normalised():
    params = SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=-2.0,
                            frequency_penalty=2.0, repetition_penalty=0.01, max_tokens=0, min_tokens=3,
                            logprobs=20, stop=["a"] * 9, stop_token_ids=[0, VOCAB - 1])
    checked = validate_sampling_params(params, VOCAB)
    assert checked.top_k == 0 and checked.max_tokens == 0 and checked.stop == ["a"] * 9
    assert validate_sampling_params(SamplingParams(top_k=40, logprobs=0), VOCAB).top_k == 40


@pytest.mark.parametrize("messages", [
    [],
    [{"role": "robot", "content": "hi"}],
    [{"content": "hi"}],
    [{"role": "user", "content": 3}],
    [{"role": "user", "content": {"text": "hi"}}],
    [{"role": "user", "content": [{"type": "text", "text": 3}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
])
def test_bad_messages(messages):
    with pytest.raises(InvalidRequest) as e:
        chat_messages(messages)
    assert e.value.error.param == "messages"


def test_text_parts_are_joined_and_roles_accepted():
    messages = [{"role": role, "content": "x"} for role in ("system", "developer", "user", "assistant", "tool")]
    messages.append({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})
    assert chat_messages(messages)[-1] == {"role": "user", "content": "a\nb"}


def test_null_content_is_empty_and_only_template_fields_are_kept():
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"x": [1, 2]}'}, "extra": 1}
    messages = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "calc", "extra": 1},
    ]
    # The arguments' JSON string becomes an object, as templates (and vLLM) take it.
    assert chat_messages(messages) == [
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "calc", "arguments": {"x": [1, 2]}}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "calc"},
    ]


@pytest.mark.parametrize("message, words", [
    ({"role": "user", "content": "x", "tool_calls": []}, "only assistant"),
    ({"role": "assistant", "tool_calls": {"id": "c1"}}, "must be a list"),
    ({"role": "assistant", "tool_calls": [{"id": "c1"}]}, "function {name, arguments}"),
    ({"role": "assistant", "tool_calls": [{"type": "x", "function": {"name": "f"}}]}, "type must be"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}, "not valid JSON"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}, "JSON object"),
])
def test_bad_tool_calls_in_messages_are_refused(message, words):
    with pytest.raises(InvalidRequest, match=words) as info:
        chat_messages([message])
    assert info.value.error.param == "messages" and info.value.error.status == 400


@pytest.mark.parametrize("fields, param", [
    (dict(), "messages"),
    (dict(prompt="a", prompt_token_ids=[1]), "prompt_token_ids"),
    (dict(messages=[{"role": "user", "content": "a"}], prompt="b"), "prompt"),
    (dict(prompt_token_ids=[1, VOCAB]), "prompt_token_ids"),
    (dict(prompt_token_ids=[-3]), "prompt_token_ids"),
])
def test_request_shape(fields, param):
    with pytest.raises(InvalidRequest) as e:
        validate_request_shape(TokenizeRequest(request_ids=["r"], gateway_id="g", **fields), VOCAB)
    assert e.value.error.param == param


def test_context_length():
    assert resolve_max_tokens(SamplingParams(max_tokens=0), 30, 100, "prompt").max_tokens == 70
    assert resolve_max_tokens(SamplingParams(max_tokens=70), 30, 100, "prompt").max_tokens == 70
    with pytest.raises(InvalidRequest) as e:
        resolve_max_tokens(SamplingParams(max_tokens=71), 30, 100, "messages")
    assert e.value.error.param == "max_tokens" and e.value.error.code == "context_length_exceeded"
    assert "maximum context length is 100 tokens" in str(e.value)
    assert "you requested 101 tokens (30 in the messages, 71 in the completion)" in str(e.value)
    with pytest.raises(InvalidRequest) as e:
        resolve_max_tokens(SamplingParams(max_tokens=0), 100, 100, "prompt")
    assert e.value.error.param == "prompt" and "resulted in 100 tokens" in str(e.value)
    with pytest.raises(InvalidRequest) as e:
        resolve_max_tokens(SamplingParams(max_tokens=0), 0, 100, "prompt")
    assert e.value.error.param == "prompt" and "empty" in str(e.value)
    with pytest.raises(InvalidRequest) as e:
        resolve_max_tokens(SamplingParams(max_tokens=0, min_tokens=80), 30, 100, "prompt")
    assert e.value.error.param == "min_tokens"
