"""logit_bias, allowed_token_ids and bad_words read at the edge."""

from __future__ import annotations

import pytest

from services.gateway.errors import ApiError
from services.gateway.openai_requests import parse_chat, parse_completion

USER = [{"role": "user", "content": "hi"}]


def test_fields_read_with_biases_clamped_as_vllm_does():
    body = {"logit_bias": {"5": 3, "7": -250.5, "9": 101}, "allowed_token_ids": [4, 2, 4], "bad_words": "x"}
    for params in (parse_chat({"messages": USER, **body}, ("m",)).sampling_params,
                   parse_completion({"prompt": "p", **body}, ("m",)).sampling_params):
        assert params.logit_bias == {5: 3.0, 7: -100.0, 9: 100.0}
        assert params.allowed_token_ids == [2, 4] and params.bad_words == ["x"]
    plain = parse_chat({"messages": USER}, ("m",)).sampling_params
    assert (plain.logit_bias, plain.allowed_token_ids, plain.bad_words) == ({}, None, [])


@pytest.mark.parametrize("fields, param", [
    ({"logit_bias": [1]}, "logit_bias"),
    ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"logit_bias": {"1": "x"}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"allowed_token_ids": ["1"]}, "allowed_token_ids"),
    ({"bad_words": [1]}, "bad_words"),
])
def test_bad_shapes_are_400s(fields, param):
    with pytest.raises(ApiError) as info:
        parse_chat({"messages": USER, **fields}, ("m",))
    assert info.value.info.param == param
