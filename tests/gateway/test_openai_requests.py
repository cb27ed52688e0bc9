"""Request parsing at the edge: defaults, fan-out settings, max_tokens encoding."""

from __future__ import annotations

import pytest

from services.gateway.errors import ApiError
from services.gateway.openai_requests import parse_chat, parse_completion

NAMES = ("m", "alias")
USER = [{"role": "user", "content": "hi"}]


def test_chat_max_tokens_absent_is_zero_and_max_completion_tokens_wins():
    assert parse_chat({"messages": USER}, NAMES).sampling_params.max_tokens == 0
    assert parse_chat({"messages": USER, "max_tokens": 5}, NAMES).sampling_params.max_tokens == 5
    r = parse_chat({"messages": USER, "max_tokens": 5, "max_completion_tokens": 7}, NAMES)
    assert r.sampling_params.max_tokens == 7


def test_completion_max_tokens_default_16_and_null_is_as_many_as_fit():
    assert parse_completion({"prompt": "x"}, NAMES).sampling_params.max_tokens == 16
    assert parse_completion({"prompt": "x", "max_tokens": None}, NAMES).sampling_params.max_tokens == 0


def test_model_defaults_to_the_first_served_name():
    assert parse_chat({"messages": USER}, NAMES).model == "m"
    assert parse_chat({"messages": USER, "model": "alias"}, NAMES).model == "m"
    with pytest.raises(ApiError) as info:
        parse_chat({"messages": USER, "model": "x"}, NAMES)
    assert info.value.info.code == "model_not_found" and info.value.status == 404


def test_seed_plus_i_and_logprobs_mapping():
    r = parse_chat({"messages": USER, "n": 3, "seed": 10, "logprobs": True}, NAMES)
    assert [r.sampling_params.for_choice(i).seed for i in range(3)] == [10, 11, 12]
    assert r.sampling_params.logprobs == 0 and r.logprobs
    assert parse_chat({"messages": USER}, NAMES).sampling_params.logprobs is None
    assert parse_chat({"messages": USER, "n": 2}, NAMES).sampling_params.for_choice(1).seed is None
    r = parse_completion({"prompt": [[1, 2], [3]], "logprobs": 3, "stop": "x"}, NAMES)
    assert r.sampling_params.logprobs == 3 and r.sampling_params.stop == ["x"]
    assert r.prompts == ({"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]})


def test_messages_are_passed_on_as_given():
    """Roles and content are the tokenizer's to check (shared.request_validation)."""
    messages = [
        {"role": "assistant", "content": None},
        {"role": "wizard", "content": [{"type": "text", "text": "a"}], "name": "u"},
    ]
    assert parse_chat({"messages": messages}, NAMES).prompts[0]["messages"] == messages


@pytest.mark.parametrize("body, param", [
    ({"messages": USER, "n": 1000}, "n"),
    ({"messages": USER, "seed": 2**63 - 1, "n": 2}, "seed"),
    ({"messages": USER, "ignore_eos": "yes"}, "ignore_eos"),
    ({"messages": USER, "stream": True, "stream_options": []}, "stream_options"),
    ({"messages": USER, "stop_token_ids": [True]}, "stop_token_ids"),
    ({"messages": USER, "min_tokens": -1}, "min_tokens"),
    ({"messages": USER, "stop": [str(i) for i in range(65)]}, "stop"),
    ({"messages": USER, "stop": "x" * 1025}, "stop"),
    ({"messages": USER, "stop_token_ids": list(range(1025))}, "stop_token_ids"),
    ({"messages": ["hi"]}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "id": 2**64}]}, "messages"),
])
def test_bad_values_name_their_param(body, param):
    with pytest.raises(ApiError) as info:
        parse_chat(body, NAMES)
    assert info.value.info.param == param and info.value.status == 400


def test_stop_strings_and_ids_are_sets_in_the_order_given():
    r = parse_chat({"messages": USER, "stop": ["b", "a", "b"], "stop_token_ids": [5, 3, 5, 5]}, NAMES)
    assert r.sampling_params.stop == ["b", "a"] and r.sampling_params.stop_token_ids == [5, 3]
    many = parse_chat({"messages": USER, "stop": ["s"] * 500}, NAMES)  # repeats count once
    assert many.sampling_params.stop == ["s"]


def test_a_non_streamed_answer_is_bounded():
    body = {"messages": USER, "n": 64, "max_tokens": 8192}
    with pytest.raises(ApiError) as info:
        parse_chat(body, NAMES)
    assert info.value.info.param == "max_tokens" and "stream it" in info.value.info.message
    assert parse_chat({**body, "stream": True}, NAMES).n == 64  # streamed: built incrementally
    with pytest.raises(ApiError):
        parse_completion({"prompt": "x", "max_tokens": 20_000, "logprobs": 20}, NAMES)
    assert parse_completion({"prompt": "x", "max_tokens": 20_000}, NAMES).sampling_params.max_tokens == 20_000


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("field, value", [
    ("functions", [TOOL["function"]]), ("function_call", "auto"), ("best_of", 3),
    ("use_beam_search", True), ("watermarking", True), ("logprob_token_ids", [5]),
    ("return_prompt_text", True),
    ("thinking_token_budget", 10), ("repetition_detection", {"max_pattern_size": 4}), ("priority", 1),
    ("vllm_xargs", {"a": 1}), ("kv_transfer_params", {"do_remote_decode": True}), ("ec_transfer_params", {}),
    ("mm_payload", {}), ("mm_processor_kwargs", {"x": 1}), ("media_io_kwargs", {"image": {}}),
    ("return_mm_kwargs", True), ("audio", {"voice": "alloy"}), ("modalities", ["text", "audio"]),
    ("web_search_options", {}),
])
def test_fields_we_cannot_honour_are_refused_by_name(field, value):
    for parse, body in ((parse_chat, {"messages": USER}), (parse_completion, {"prompt": "x"})):
        with pytest.raises(ApiError) as info:
            parse({**body, field: value}, NAMES)
        assert info.value.status == 400 and info.value.info.param == field
        assert "not supported" in info.value.info.message


@pytest.mark.parametrize("field, value", [
    ("tools", [TOOL]), ("tool_choice", "required"), ("parallel_tool_calls", False),
    ("chat_template_kwargs", {"enable_thinking": True}), ("continue_final_message", True),
    ("documents", [{"title": "a", "text": "b"}]), ("prompt_embeds", "AAAA"),
])
def test_chat_fields_are_refused_on_completions(field, value):
    with pytest.raises(ApiError) as info:
        parse_completion({"prompt": "x", field: value}, NAMES)
    assert info.value.status == 400 and info.value.info.param == field
    assert "not supported" in info.value.info.message


def test_a_requests_own_chat_template_is_refused():
    with pytest.raises(ApiError) as info:
        parse_chat({"messages": USER, "chat_template": "{{ messages }}"}, NAMES)
    assert info.value.info.param == "chat_template" and "not supported" in info.value.info.message


def test_their_inert_values_pass():
    inert = {"tools": [], "tool_choice": "none", "echo": False, "chat_template_kwargs": {},
             "best_of": 2, "n": 2, "use_beam_search": False, "priority": 0, "modalities": ["text"],
             "return_token_ids": None, "vllm_xargs": {}, "continue_final_message": False, "documents": []}
    assert parse_chat({"messages": USER, **inert}, NAMES).n == 2
    assert parse_completion({"prompt": "x", **inert}, NAMES).n == 2


def test_fields_that_change_nothing_here_pass_as_in_vllm():
    """No reasoning parser, no beam search, nothing stored: vLLM ignores these for such a model."""
    fields = {"user": "u", "session_id": "s", "reasoning_effort": "low", "include_reasoning": False,
              "length_penalty": 0.5, "early_stopping": True, "return_token_offsets": True,
              "routed_experts_prompt_start": 3, "store": True, "metadata": {"k": "v"}, "service_tier": "auto",
              "prediction": {"type": "content", "content": "x"}, "verbosity": "low"}
    assert parse_chat({"messages": USER, **fields}, NAMES).prompts[0]["messages"] == USER


def test_prompt_rendering_fields_reach_the_tokenize_request():
    """continue_final_message, documents, add_special_tokens and truncation_side (vLLM's)
    travel in the prompt's TokenizeRequest fields, each only when it is not its default."""
    plain = parse_chat({"messages": USER}, NAMES).prompts[0]
    assert plain.keys() == {"messages", "tools", "chat_template_kwargs"}
    docs = [{"title": "a", "text": "b"}]
    chat = parse_chat({"messages": USER, "add_generation_prompt": False, "continue_final_message": True,
                       "documents": docs, "chat_template_kwargs": {"x": 1}, "add_special_tokens": True,
                       "truncation_side": "right", "truncate_prompt_tokens": 4}, NAMES)
    assert chat.prompts[0] == {"messages": USER, "tools": None, "continue_final_message": True,
                               "chat_template_kwargs": {"documents": docs, "x": 1},
                               "add_special_tokens": True, "truncation_side": "right"}
    assert not chat.add_generation_prompt
    ours = parse_chat({"messages": USER, "documents": docs, "chat_template_kwargs": {"documents": []}}, NAMES)
    assert ours.prompts[0]["chat_template_kwargs"] == {"documents": []}  # chat_template_kwargs win, as vLLM
    completion = parse_completion({"prompt": ["a", "b"], "add_special_tokens": False, "truncation_side": "left"},
                                  NAMES)
    assert completion.prompts == ({"prompt": "a", "add_special_tokens": False},
                                  {"prompt": "b", "add_special_tokens": False})


@pytest.mark.parametrize("body, param", [
    ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt is true by default
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"truncation_side": "middle"}, "truncation_side"),
    ({"documents": [{"title": 1}]}, "documents"),
    ({"documents": "text"}, "documents"),
    ({"add_special_tokens": "yes"}, "add_special_tokens"),
    ({"chat_template_kwargs": {"continue_final_message": True}}, "chat_template_kwargs"),
])
def test_bad_prompt_rendering_fields_are_400(body, param):
    with pytest.raises(ApiError) as info:
        parse_chat({"messages": USER, **body}, NAMES)
    assert info.value.status == 400 and info.value.info.param == param


def test_output_text_settings_reach_the_sampling_params():
    fields = {"include_stop_str_in_output": True, "skip_special_tokens": False, "spaces_between_special_tokens": False,
              "return_tokens_as_token_ids": True}
    for parse, body in ((parse_chat, {"messages": USER}), (parse_completion, {"prompt": "x"})):
        params = parse({**body, **fields}, NAMES).sampling_params
        assert (params.include_stop_str_in_output, params.skip_special_tokens,
                params.spaces_between_special_tokens, params.return_tokens_as_token_ids) == (True, False, False, True)
        assert params.has_text_settings  # the detokenizers are told
        # Token ids as names change nothing without logprobs: no settings message for them alone.
        assert not parse({**body, "return_tokens_as_token_ids": True}, NAMES).sampling_params.has_text_settings
        assert parse({**body, "return_tokens_as_token_ids": True, "logprobs": 0 if body.get("prompt") else True},
                     NAMES).sampling_params.has_text_settings
        default = parse({**body, "skip_special_tokens": None}, NAMES).sampling_params
        assert (default.include_stop_str_in_output, default.skip_special_tokens,
                default.spaces_between_special_tokens, default.return_tokens_as_token_ids) == (False, True, True, False)
        for name in fields:
            with pytest.raises(ApiError) as info:
                parse({**body, name: "yes"}, NAMES)
            assert info.value.status == 400 and info.value.info.param == name


def test_truncate_prompt_tokens_is_checked_at_the_edge():
    for parse, body in ((parse_chat, {"messages": USER}), (parse_completion, {"prompt": "x"})):
        assert parse({**body, "truncate_prompt_tokens": 5}, NAMES).sampling_params.truncate_prompt_tokens == 5
        assert parse({**body, "truncate_prompt_tokens": -1}, NAMES).sampling_params.truncate_prompt_tokens == -1
        assert parse(body, NAMES).sampling_params.truncate_prompt_tokens is None
        for bad in (0, -2, 1.5, "3"):
            with pytest.raises(ApiError) as info:
                parse({**body, "truncate_prompt_tokens": bad}, NAMES)
            assert info.value.status == 400 and info.value.info.param == "truncate_prompt_tokens"


def test_fields_nothing_reads_are_logged_as_vllm_logs_them(caplog):
    """vLLM's warning for a request's unknown fields (completions have no max_completion_tokens
    in vLLM either); fields read, refused-unless-inert or without effect are not named."""
    with caplog.at_level("WARNING", logger="services.gateway.openai_requests"):
        parse_chat({"messages": USER, "user": "u", "session_id": "s", "seed": 1, "top_k": 3, "logprobs": True,
                    "use_beam_search": False, "documents": [], "return_token_ids": True}, NAMES)
        assert not caplog.records
        parse_completion({"prompt": "x", "max_completion_tokens": 5, "frobnicate": 1, "seed": 2}, NAMES)
    assert [r.getMessage() for r in caplog.records] == [
        "The following fields were present in the request but ignored: ['frobnicate', 'max_completion_tokens']"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="services.gateway.openai_requests"):  # OpenAI's, unknown to vLLM
        parse_chat({"messages": USER, "store": True, "metadata": {"k": "v"}}, NAMES)
    assert [r.getMessage() for r in caplog.records] == [
        "The following fields were present in the request but ignored: ['metadata', 'store']"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="services.gateway.openai_requests"):  # bounded, whatever is sent
        parse_completion({"prompt": "x", **{f"{'f' * 100}{i:03}": 1 for i in range(300)}}, NAMES)
    [record] = caplog.records
    assert record.getMessage().endswith("and 290 more") and len(record.getMessage()) < 1000
