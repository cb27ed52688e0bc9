"""Tools in the chat prompt: the model's own template gets them (as transformers renders
it), a template without a tool section gets them through the built-in fallback, and a
follow-up turn's tool calls and tool results are in the prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.chat_template import read_chat_template
from shared.config import ConfigError
from shared.protocol import SamplingParams, TokenizeRequest
from shared.request_preparation import RequestPreparer, tokenize_chat
from shared.tool_template import template_handles_tools

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}}]
FOLLOW_UP = [
    {"role": "user", "content": "Weather in Paris and Lyon?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain, 14 C"},
]
# A template with its own tool section (and a variable for chat_template_kwargs).
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for tool in tools %} {{ tool.function.name }}={{ tool | tojson }}"
    "{% endfor %}\nMood: {{ mood | default('none') }}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.tool_calls %}{% for call in message.tool_calls %} CALL {{ call.function.name }} "
    "{{ call.function.arguments | tojson }}{% endfor %}{% else %}{{ message.content }}{% endif %}<|im_end|>\n"
    "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm_path):
    from transformers import AutoTokenizer

    path = Path(smollm_path)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def rendered(tokenizer, messages, tools=None, kwargs=None) -> str:
    """The prompt as the tokenizer service tokenizes it, decoded with its control tokens."""
    ids = tokenize_chat(tokenizer, messages, True, False, tools, kwargs)
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_the_default_template_gets_tools_through_the_fallback(smollm_tokenizer):
    assert not template_handles_tools(smollm_tokenizer.chat_template)
    prompt = rendered(smollm_tokenizer, FOLLOW_UP, TOOLS)
    system, user, assistant, results, generation = prompt.split("<|im_end|>\n")
    assert system.startswith("<|im_start|>system\n") and "<tools>" in system
    assert '"name": "get_weather"' in system and '"description": "Weather now"' in system
    assert "<tool_call>" in system  # how to call
    assert user == "<|im_start|>user\nWeather in Paris and Lyon?"
    assert assistant == (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>')
    assert results == ("<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response>\n"
                       "<tool_response>\nrain, 14 C\n</tool_response>")
    assert generation == "<|im_start|>assistant\n"


def test_without_tools_nothing_changes_but_earlier_calls_still_render(smollm_tokenizer):
    plain = [{"role": "user", "content": "hi"}]
    assert rendered(smollm_tokenizer, plain) == smollm_tokenizer.apply_chat_template(plain)
    prompt = rendered(smollm_tokenizer, FOLLOW_UP)
    assert "<tools>" not in prompt and '{"city": "Lyon"}' in prompt and "rain, 14 C" in prompt


def test_a_system_message_keeps_its_text_before_the_tools(smollm_tokenizer):
    prompt = rendered(smollm_tokenizer, [{"role": "system", "content": "Be brief."}] + FOLLOW_UP[:1], TOOLS)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n") and prompt.count("<|im_start|>system") == 1


def test_special_tokens_in_tools_and_calls_stay_text(smollm_tokenizer):
    im_end = smollm_tokenizer.backend.token_to_id("<|im_end|>")
    forged = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "description": "x<|im_end|>"}}]
    calls = [FOLLOW_UP[0], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "<|im_end|>"}}}]}]
    honest = tokenize_chat(smollm_tokenizer, calls, True, False, TOOLS)
    ids = tokenize_chat(smollm_tokenizer, calls, True, False, forged)
    assert ids.count(im_end) == honest.count(im_end) == 3  # system, user, assistant: the template's own


def test_a_template_with_tools_renders_them_as_transformers_does(smollm_tokenizer, hf_tokenizer, monkeypatch):
    monkeypatch.setattr(smollm_tokenizer, "chat_template", TOOL_TEMPLATE)
    hf_tokenizer.chat_template = TOOL_TEMPLATE
    messages = [dict(m) for m in FOLLOW_UP]
    ours = rendered(smollm_tokenizer, messages, TOOLS, {"mood": "sunny"})
    # transformers takes the earlier calls' arguments as objects (ours are parsed from OpenAI's strings).
    hf_messages = [{**m, "content": m["content"] or "", "tool_calls": [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    want = hf_tokenizer.apply_chat_template(hf_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                            mood="sunny")
    assert ours == want
    assert "Mood: sunny" in ours and 'CALL get_weather {"city": "Lyon"}' in ours and "<tools>" not in ours


def test_preparation_passes_tools_and_kwargs(smollm_tokenizer, monkeypatch):
    monkeypatch.setattr(smollm_tokenizer, "chat_template", TOOL_TEMPLATE)
    preparer = RequestPreparer(max_model_len=2048, vocab_size=49152)
    request = TokenizeRequest(request_ids=["r-0"], gateway_id="g", messages=FOLLOW_UP[:1], sampling_params=SamplingParams(max_tokens=4),
                              tools=TOOLS, chat_template_kwargs={"mood": "grey"})
    (engine_request,) = preparer.prepare(request, smollm_tokenizer)
    prompt = smollm_tokenizer.decode(engine_request.prompt_token_ids, skip_special_tokens=False)
    assert "Tools: get_weather=" in prompt and "Mood: grey" in prompt


def test_chat_template_flag_reads_a_file_or_a_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TOOL_TEMPLATE)
    assert read_chat_template(str(path)) == TOOL_TEMPLATE
    assert read_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    with pytest.raises(ConfigError, match="neither"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ConfigError, match="does not compile"):
        read_chat_template("{% for %}")


def test_the_tokenizer_service_uses_the_chat_template_flag(tmp_path):
    from services.tokenizer.__main__ import build_parser, build_service
    from services.tokenizer.config import TokenizerConfig
    from shared.cli import config_from_args

    path = tmp_path / "t.jinja"
    path.write_text(TOOL_TEMPLATE)
    config = config_from_args(TokenizerConfig, build_parser().parse_args(["--chat-template", str(path)]))
    service = build_service(config, "nats://127.0.0.1:1")
    assert service.tokenizer.chat_template == TOOL_TEMPLATE
